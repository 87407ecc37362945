"""More zoo networks, written with :class:`~shardplan.ir.builder.GraphBuilder`: MLP, VGG-16, GNMT, GPT.

Conventions shared with :mod:`shardplan.zoo.pase_models`:

* No biases anywhere (the builder's convolutions and einsums have none; linears are kept bias-free
  too, so every model counts parameters the same way). Pointwise activations are fused into the
  producing contraction as ``pw_ops`` (ReLU, tanh, GeLU: one pointwise op each).
* Dropout, causal masks and the attention scaling are not modelled as ops (they change no shape
  and are folded into the neighbouring op's cost).
* FLOPs are forward FLOPs with a multiply-add counted as 2 (see :class:`shardplan.ir.graph.Op`).
"""

from __future__ import annotations

from typing import Sequence

from shardplan.ir.builder import GraphBuilder
from shardplan.ir.graph import Graph

__all__ = ["GPT_SIZES", "GPT_SEQ", "gnmt", "gpt", "mlp", "vgg16"]


# -- MLP ---------------------------------------------------------------------------------------

def mlp(batch: int = 64, hidden: Sequence[int] = (4096, 4096, 4096), in_features: int = 1024,
        num_classes: int = 1000) -> Graph:
    """A plain multi-layer perceptron: ``len(hidden)`` linears with ReLU fused, a classifier linear and
    softmax-xent (``len(hidden) + 2`` ops; 5 with the defaults, 41,844,736 parameters)."""
    b = GraphBuilder("mlp")
    x = b.input("x", (batch, in_features), ("batch", "features"))
    for i, width in enumerate(hidden):
        b.layer = i
        b.module = f"layers.{i}"
        x = b.linear(x, int(width), pw_ops=1, name=f"fc{i + 1}")
    b.layer = None
    b.module = "classifier"
    x = b.linear(x, num_classes, name="classifier")
    b.softmax_xent(x, name="loss")
    return b.build(pase_cutoff=1, family="mlp")


# -- VGG-16 ------------------------------------------------------------------------------------

# Configuration "D" of Simonyan & Zisserman (2015): channels per conv, "M" a 2x2/2 max pool.
VGG16_CONFIG: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                                       512, 512, 512, "M", 512, 512, 512, "M")


def vgg16(batch: int = 64, num_classes: int = 1000) -> Graph:
    """VGG-16 (configuration D) on 224x224 images.

    13 convs 3x3 / pad 1 with ReLU fused, 5 max pools 2x2 / stride 2, flatten (a reshape: two ops,
    ravel and unravel), fc 4096 -> 4096 -> ``num_classes`` (ReLU fused on the first two), softmax-xent:
    24 ops. Dropout is omitted. Without biases the 1000-class model has 138,344,128 parameters
    (torchvision's 138,357,544 minus its 13,416 biases).
    """
    b = GraphBuilder("vgg16")
    x = b.input("image", (batch, 3, 224, 224), ("batch", "channels", "height", "width"))
    block, conv_in_block = 1, 0
    for item in VGG16_CONFIG:
        b.layer = block - 1
        b.module = f"features.block{block}"
        if item == "M":
            x = b.pool2d(x, 2, stride=2, name=f"pool{block}")
            block, conv_in_block = block + 1, 0
        else:
            conv_in_block += 1
            x = b.conv2d(x, int(item), 3, padding=1, pw_ops=1, name=f"conv{block}_{conv_in_block}")
    b.layer = None
    b.module = "classifier"
    _, c, h, w = b.shape(x)
    x = b.reshape(x, (batch, c * h * w), ("batch", "features"), name="flatten")
    x = b.linear(x, 4096, pw_ops=1, name="fc6")
    x = b.linear(x, 4096, pw_ops=1, name="fc7")
    x = b.linear(x, num_classes, name="fc8")
    b.softmax_xent(x, name="loss")
    return b.build(pase_cutoff=4, family="cnn")


# -- GNMT --------------------------------------------------------------------------------------

def gnmt(batch: int = 64, seq: int = 40, hidden: int = 1024, vocab: int = 32000, layers: int = 4) -> Graph:
    """A GNMT-shaped LSTM encoder-decoder with attention (Wu et al. 2016), at the builder's granularity.

    Ops (14 for any ``layers >= 2``)::

        src_embed, enc.fwd, enc.bwd, enc.merge, enc.lstm,       # encoder
        tgt_embed, dec.lstm,                                    # decoder
        attn.scores, attn.softmax, attn.context, attn.concat, attn.combine,
        proj, loss

    What follows GNMT: word-piece vocabulary shared by source and target (32k), 1024-wide
    embeddings and LSTMs, a bidirectional first encoder layer followed by ``layers - 1``
    unidirectional ones, a ``layers``-deep decoder, attention over all encoder states, a softmax
    over the vocabulary. (The paper uses 8+8 layers; pass ``layers=8`` for that depth.)

    Simplifications, forced by the builder's one-op-per-stack ``lstm``:

    * The bidirectional layer is two 1-layer LSTM ops over the same embeddings (``enc.fwd`` and
      ``enc.bwd``, a time reversal changes no shape), merged by a sum rather than a concatenation,
      so encoder layer 2 sees an ``hidden``-wide input (its input weight is 4h x h, not 4h x 2h).
    * No residual connections inside the LSTM stacks (GNMT adds them from layer 3 on).
    * Luong-style dot-product attention on the top decoder layer's output (``attn.scores`` /
      ``attn.context`` einsums against the encoder states), combined with the decoder output as
      ``tanh(W [context; state])`` (``attn.concat`` + ``attn.combine``). GNMT uses additive attention
      from the bottom decoder layer and feeds the context into every decoder layer.
    * Source and target sentences both have ``seq`` tokens; embeddings are not tied to the output
      projection; no biases.

    Parameters (no biases): ``3 * vocab * hidden + 8 * hidden^2 * (2 + (layers - 1) + layers)
    + 2 * hidden^2``; 175,898,624 with the defaults.
    """
    if layers < 1:
        raise ValueError(f"gnmt needs at least one layer, got layers={layers}")
    b = GraphBuilder("gnmt")
    src = b.input("src_tokens", (batch, seq), ("batch", "seq"))
    tgt = b.input("tgt_tokens", (batch, seq), ("batch", "seq"))

    b.module = "encoder"
    x = b.embedding(src, vocab, hidden, name="src_embed")
    b.layer = 0
    fwd = b.lstm(x, hidden, 1, name="enc.fwd")
    bwd = b.lstm(x, hidden, 1, name="enc.bwd")
    enc = b.add(fwd, bwd, name="enc.merge")
    if layers > 1:
        b.layer = 1
        enc = b.lstm(enc, hidden, layers - 1, name="enc.lstm")

    b.module = "decoder"
    b.layer = None
    y = b.embedding(tgt, vocab, hidden, name="tgt_embed")
    b.layer = layers
    dec = b.lstm(y, hidden, layers, name="dec.lstm")

    b.module = "attention"
    scores = b.einsum("bld,bmd->blm", dec, enc, name="attn.scores")
    weights = b.softmax(scores, 2, name="attn.softmax")
    ctx = b.einsum("blm,bmd->bld", weights, enc, name="attn.context")
    both = b.concat([ctx, dec], 2, name="attn.concat")
    att = b.linear(both, hidden, pw_ops=1, name="attn.combine")  # tanh fused

    b.layer = None
    b.module = "head"
    logits = b.linear(att, vocab, name="proj")
    b.softmax_xent(logits, name="loss")
    return b.build(pase_cutoff=1, family="rnn")


# -- GPT ---------------------------------------------------------------------------------------

# (layers, hidden, heads) of the GPT-3 family, Brown et al. 2020, Table 2.1 (all with context 2048).
GPT_SIZES: dict[str, tuple[int, int, int]] = {
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 16),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "175b": (96, 12288, 96),
    "530b": (105, 20480, 128),  # Megatron-Turing NLG 530B (Smith et al. 2022, arXiv 2201.11990)
}
GPT_SEQ = 2048  # context length of every named size


def gpt(size: str | None = None, layers: int = 12, hidden: int = 768, heads: int = 12, seq: int = 1024,
        vocab: int = 50257, batch: int = 8, ffn: int | None = None, pad_vocab_to: int = 128) -> Graph:
    """GPT-style decoder-only transformer (GPT-2 / GPT-3 layout, pre-norm).

    ``size`` (a key of :data:`GPT_SIZES`, e.g. ``"125m"``) sets ``layers``, ``hidden`` and ``heads``
    from GPT-3's Table 2.1 and ``seq = 2048``, overriding those arguments. ``ffn`` defaults to
    ``4 * hidden``.

    Ops: ``tok_embed``, ``pos_embed`` (a lookup of position ids in a learned ``seq x hidden`` table),
    ``pos_add``; per layer ``i`` (``b.layer = i``, modules ``layers.i.ln1 / attn / ln2 / mlp``)::

        ln1, attn.qkv (fused, 'ble,shek->sbhlk' with s = 3), attn.split (unstack q, k, v),
        attn.scores, attn.softmax, attn.context, attn.out, res1,
        ln2, mlp.up (GeLU fused, pw_ops=1), mlp.down, res2

    then ``final_norm``, ``lm_head`` (tied to the token embedding, as GPT-2/3) and ``loss``:
    ``12 * layers + 6`` ops.

    The vocabulary is padded up to a multiple of ``pad_vocab_to`` (Megatron-LM's
    ``make-vocab-size-divisible-by``, default 128: 50257 -> 50304) so the vocab dim can be split;
    ``pad_vocab_to=1`` keeps it as given. No biases (einsums have none); causal mask and
    ``1/sqrt(d)`` scaling are folded into the softmax.

    Parameters: ``layers * (4 h^2 + 2 h ffn + 4 h) + 2 h + V h + seq h`` with ``V`` the padded
    vocabulary (125,179,392 for ``"125m"``).
    Forward FLOPs of the contractions of one layer (ffn = 4h): ``24 b s h^2 + 4 b s^2 h``.
    """
    if size is not None:
        if size not in GPT_SIZES:
            raise ValueError(f"unknown gpt size {size!r}; valid sizes: {', '.join(GPT_SIZES)}")
        layers, hidden, heads = GPT_SIZES[size]
        seq = GPT_SEQ
    for arg, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq),
                       ("vocab", vocab), ("batch", batch), ("pad_vocab_to", pad_vocab_to)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"gpt: {arg} must be a positive integer, got {value!r}")
    if hidden % heads:
        raise ValueError(f"gpt: hidden={hidden} is not divisible by heads={heads}")
    ffn = 4 * hidden if ffn is None else ffn
    if not isinstance(ffn, int) or ffn < 1:
        raise ValueError(f"gpt: ffn must be a positive integer, got {ffn!r}")
    padded_vocab = -(-vocab // pad_vocab_to) * pad_vocab_to
    d_k = hidden // heads

    b = GraphBuilder(f"gpt-{size}" if size else "gpt")
    ids = b.input("tokens", (batch, seq), ("batch", "seq"))
    pos_ids = b.input("positions", (batch, seq), ("batch", "seq"))

    b.module = "embed"
    tok = b.embedding(ids, padded_vocab, hidden, name="tok_embed")
    pos = b.embedding(pos_ids, seq, hidden, name="pos_embed")
    x = b.add(tok, pos, name="pos_add")

    for i in range(layers):
        b.layer = i
        t = f"layers.{i}"
        b.module = f"{t}.ln1"
        h = b.layer_norm(x, name=f"{t}.ln1")
        b.module = f"{t}.attn"
        qkv = b.einsum("ble,shek->sbhlk", h, (3, heads, hidden, d_k), name=f"{t}.attn.qkv")
        q, k, v = b.unstack(qkv, 0, name=f"{t}.attn.split")
        scores = b.einsum("bhlk,bhmk->bhlm", q, k, name=f"{t}.attn.scores")
        probs = b.softmax(scores, 3, name=f"{t}.attn.softmax")
        ctx = b.einsum("bhlm,bhmk->bhlk", probs, v, name=f"{t}.attn.context")
        a = b.einsum("bhlk,hek->ble", ctx, (heads, hidden, d_k), name=f"{t}.attn.out")
        x = b.add(x, a, name=f"{t}.res1")
        b.module = f"{t}.ln2"
        h = b.layer_norm(x, name=f"{t}.ln2")
        b.module = f"{t}.mlp"
        up = b.einsum("ble,ef->blf", h, (hidden, ffn), pw_ops=1, name=f"{t}.mlp.up")  # GeLU fused
        down = b.einsum("blf,fe->ble", up, (ffn, hidden), name=f"{t}.mlp.down")
        x = b.add(x, down, name=f"{t}.res2")

    b.layer = None
    b.module = "final_norm"
    x = b.layer_norm(x, name="final_norm")
    b.module = "lm_head"
    logits = b.einsum("ble,ve->blv", x, "tok_embed.weight", name="lm_head")  # tied embedding
    b.softmax_xent(logits, name="loss")
    return b.build(pase_cutoff=1, family="transformer", size=size, layers=layers, hidden=hidden,
                   heads=heads, seq=seq, vocab=padded_vocab, ffn=ffn)
