"""From PyTorch to the graph IR (imports torch; the planner core does not).

The package is itself callable: ``shardplan.capture(module, example_inputs)`` is
``shardplan.capture.capture(module, example_inputs)``, the front door the rest of shardplan and its
users call (``import shardplan`` loads this package, and torch, on first use of the name).
"""

import sys
import types

from shardplan.capture.export import CaptureError, capture

__all__ = ["CaptureError", "capture"]


class _CallablePackage(types.ModuleType):
    """This package's type: a module whose call is :func:`capture` (module ``__class__`` assignment)."""

    def __call__(self, module, example_inputs=(), example_kwargs=None, **options):
        return capture(module, example_inputs, example_kwargs, **options)


sys.modules[__name__].__class__ = _CallablePackage
