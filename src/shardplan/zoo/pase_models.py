"""PaSE's benchmark graphs (Elango, IPDPS 2021), op for op, so results compare one to one.

Shapes follow PaSE's public ``graph.py`` (see ``shared/reference/pase.md`` section 3): AlexNet with a
1024-class last layer, ResNet-101 on 227x227 inputs, Inception-v3 without the aux head, RNNLM with
one multi-layer LSTM op, and the "small" Transformer (d_model 512, 8 heads, 6+6 layers).
Batch sizes default to the paper's: 128 for the CNNs, 64 for RNNLM and the Transformer.
"""

from __future__ import annotations

from shardplan.ir.builder import GraphBuilder
from shardplan.ir.graph import Graph


def alexnet(batch: int = 128, num_classes: int = 1024) -> Graph:
    """AlexNet as in PaSE: 5 convs (ReLU fused), 3 pools, reshape, 3 FCs, softmax-xent (14 ops)."""
    b = GraphBuilder("alexnet")
    x = b.input("image", (batch, 3, 227, 227), ("batch", "channels", "height", "width"))
    x = b.conv2d(x, 96, 11, stride=4, pw_ops=1, name="conv1")
    x = b.pool2d(x, 3, stride=2, name="pool1")
    x = b.conv2d(x, 256, 5, padding=2, pw_ops=1, name="conv2")
    x = b.pool2d(x, 3, stride=2, name="pool2")
    x = b.conv2d(x, 384, 3, padding=1, pw_ops=1, name="conv3")
    x = b.conv2d(x, 384, 3, padding=1, pw_ops=1, name="conv4")
    x = b.conv2d(x, 256, 3, padding=1, pw_ops=1, name="conv5")
    x = b.pool2d(x, 3, stride=2, name="pool5")
    x = b.reshape(x, (batch, 256 * 6 * 6), ("batch", "features"), name="flatten")
    x = b.linear(x, 4096, pw_ops=1, name="fc6")
    x = b.linear(x, 4096, pw_ops=1, name="fc7")
    x = b.linear(x, num_classes, name="fc8")
    b.softmax_xent(x, name="loss")
    return b.build(pase_cutoff=4)


def resnet101(batch: int = 128, num_classes: int = 1000, blocks: tuple[int, ...] = (3, 4, 23, 3)) -> Graph:
    """ResNet-101 as in PaSE: bottlenecks with BatchNorm after every conv (245 ops)."""
    b = GraphBuilder("resnet101")
    expansion = 4
    x = b.input("image", (batch, 3, 227, 227), ("batch", "channels", "height", "width"))

    def conv_bn(x: str, out: int, kernel: int, stride: int = 1, padding: int = 0, tag: str = "") -> str:
        y = b.conv2d(x, out, kernel, stride=stride, padding=padding, name=f"{tag}.conv")
        return b.batch_norm(y, name=f"{tag}.bn")

    x = conv_bn(x, 64, 7, stride=2, padding=3, tag="stem")
    x = b.pool2d(x, 3, stride=2, padding=1, name="stem.pool")
    inplanes = 64
    for stage, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
        for i in range(count):
            stride = 2 if (i == 0 and stage > 1) else 1
            tag = f"layer{stage}.{i}"
            b.layer = sum(blocks[: stage - 1]) + i
            identity = x
            y = conv_bn(x, planes, 1, tag=f"{tag}.a")
            y = conv_bn(y, planes, 3, stride=stride, padding=1, tag=f"{tag}.b")
            y = conv_bn(y, planes * expansion, 1, tag=f"{tag}.c")
            if i == 0 and (stride != 1 or inplanes != planes * expansion):
                identity = conv_bn(x, planes * expansion, 1, stride=stride, tag=f"{tag}.down")
            x = b.add(y, identity, pw_ops=1, name=f"{tag}.add")
            inplanes = planes * expansion
    b.layer = None
    x = b.reduce_mean(x, (2, 3), name="avgpool")
    x = b.linear(x, num_classes, name="fc")
    b.softmax_xent(x, name="loss")
    return b.build(pase_cutoff=4)


def inception_v3(batch: int = 128, num_classes: int = 1000) -> Graph:
    """Inception-v3 as in PaSE (torchvision layout, BatchNorm after each conv, no aux head; 219 ops)."""
    b = GraphBuilder("inception_v3")
    x = b.input("image", (batch, 3, 299, 299), ("batch", "channels", "height", "width"))
    counter = [0]

    def conv(x: str, out: int, kernel, stride=1, padding=0) -> str:
        counter[0] += 1
        y = b.conv2d(x, out, kernel, stride=stride, padding=padding, name=f"conv{counter[0]}")
        return b.batch_norm(y, name=f"bn{counter[0]}")

    def block_a(x: str, cin: int, pool_features: int) -> str:
        b1 = conv(x, 64, 1)
        b5 = conv(conv(x, 48, 1), 64, 5, padding=2)
        b3 = conv(conv(conv(x, 64, 1), 96, 3, padding=1), 96, 3, padding=1)
        bp = conv(b.pool2d(x, 3, stride=1, padding=1), pool_features, 1)
        return b.concat([b1, b5, b3, bp], 1)

    def block_b(x: str, cin: int) -> str:
        b3 = conv(x, 384, 3, stride=2)
        bd = conv(conv(conv(x, 64, 1), 96, 3, padding=1), 96, 3, stride=2)
        bp = b.pool2d(x, 3, stride=2)
        return b.concat([b3, bd, bp], 1)

    def block_c(x: str, cin: int, c7: int) -> str:
        b1 = conv(x, 192, 1)
        b7 = conv(conv(conv(x, c7, 1), c7, (1, 7), padding=(0, 3)), 192, (7, 1), padding=(3, 0))
        bd = conv(x, c7, 1)
        bd = conv(bd, c7, (7, 1), padding=(3, 0))
        bd = conv(bd, c7, (1, 7), padding=(0, 3))
        bd = conv(bd, c7, (7, 1), padding=(3, 0))
        bd = conv(bd, 192, (1, 7), padding=(0, 3))
        bp = conv(b.pool2d(x, 3, stride=1, padding=1), 192, 1)
        return b.concat([b1, b7, bd, bp], 1)

    def block_d(x: str, cin: int) -> str:
        b3 = conv(conv(x, 192, 1), 320, 3, stride=2)
        b7 = conv(x, 192, 1)
        b7 = conv(b7, 192, (1, 7), padding=(0, 3))
        b7 = conv(b7, 192, (7, 1), padding=(3, 0))
        b7 = conv(b7, 192, 3, stride=2)
        bp = b.pool2d(x, 3, stride=2)
        return b.concat([b3, b7, bp], 1)

    def block_e(x: str, cin: int) -> str:
        b1 = conv(x, 320, 1)
        b3 = conv(x, 384, 1)
        b3 = b.concat([conv(b3, 384, (1, 3), padding=(0, 1)), conv(b3, 384, (3, 1), padding=(1, 0))], 1)
        bd = conv(conv(x, 448, 1), 384, 3, padding=1)
        bd = b.concat([conv(bd, 384, (1, 3), padding=(0, 1)), conv(bd, 384, (3, 1), padding=(1, 0))], 1)
        bp = conv(b.pool2d(x, 3, stride=1, padding=1), 192, 1)
        return b.concat([b1, b3, bd, bp], 1)

    x = conv(x, 32, 3, stride=2)
    x = conv(x, 32, 3)
    x = conv(x, 64, 3, padding=1)
    x = b.pool2d(x, 3, stride=2)
    x = conv(x, 80, 1)
    x = conv(x, 192, 3)
    x = b.pool2d(x, 3, stride=2)
    blocks = [(block_a, (192, 32)), (block_a, (256, 64)), (block_a, (288, 64)), (block_b, (288,)),
              (block_c, (768, 128)), (block_c, (768, 160)), (block_c, (768, 160)), (block_c, (768, 192)),
              (block_d, (768,)), (block_e, (1280,)), (block_e, (2048,))]
    for i, (fn, args) in enumerate(blocks):
        b.layer = i
        x = fn(x, *args)
    b.layer = None
    x = b.reduce_mean(x, (2, 3), name="avgpool")
    x = b.linear(x, num_classes, name="fc")
    b.softmax_xent(x, name="loss")
    return b.build(pase_cutoff=4)


def rnnlm(batch: int = 64, seq: int = 256, vocab: int = 100_000, hidden: int = 2048, layers: int = 2) -> Graph:
    """RNN language model as in PaSE: embedding, one 2-layer LSTM op, projection, softmax-xent (4 ops)."""
    b = GraphBuilder("rnnlm")
    ids = b.input("tokens", (batch, seq), ("batch", "seq"))
    x = b.embedding(ids, vocab, hidden, name="embed")
    x = b.lstm(x, hidden, layers, name="lstm")
    x = b.linear(x, vocab, name="proj")
    b.softmax_xent(x, name="loss")
    return b.build(pase_cutoff=1)


def transformer(batch: int = 64, seq: int = 256, vocab: int = 50_000, d_model: int = 512, heads: int = 8,
                d_ff: int = 2048, layers: int = 6) -> Graph:
    """PaSE's encoder-decoder Transformer ("small": 6+6 layers, d_model 512, 8 heads).

    Self-attention projects q, k, v with one einsum ``ble,shek->sbhlk`` (stack dim s = 3); the
    decoder's cross-attention stacks ``[x, enc, enc]`` first. Pre-norm residual blocks, learned
    positions added to the embeddings, no final norm (204 ops, 280 transfers, as PaSE's code).
    """
    b = GraphBuilder("transformer")
    d_k = d_model // heads
    enc_ids = b.input("src_tokens", (batch, seq), ("batch", "seq"))
    dec_ids = b.input("tgt_tokens", (batch, seq), ("batch", "seq"))
    pos = b.input("positions", (batch, seq, d_model), ("batch", "seq", "embed"))

    def attention(tag: str, x: str, memory: str | None) -> str:
        if memory is None:
            qkv = b.einsum("ble,shek->sbhlk", x, (3, heads, d_model, d_k), name=f"{tag}.qkv")
        else:
            stacked = b.stack([x, memory, memory], 0, name=f"{tag}.stack")
            qkv = b.einsum("sble,shek->sbhlk", stacked, (3, heads, d_model, d_k), name=f"{tag}.qkv")
        q, k, v = b.unstack(qkv, 0, name=f"{tag}.split")
        logits = b.einsum("bhlk,bhmk->bhlm", q, k, name=f"{tag}.scores")
        weights = b.softmax(logits, 3, name=f"{tag}.softmax")
        ctx = b.einsum("bhlm,bhmk->bhlk", weights, v, name=f"{tag}.context")
        return b.einsum("bhlk,hek->ble", ctx, (heads, d_model, d_k), name=f"{tag}.out")

    def feed_forward(tag: str, x: str) -> str:
        h = b.einsum("ble,ef->blf", x, (d_model, d_ff), pw_ops=2, name=f"{tag}.ff1")
        return b.einsum("blf,fe->ble", h, (d_ff, d_model), name=f"{tag}.ff2")

    x = b.add(b.embedding(enc_ids, vocab, d_model, name="enc.embed"), pos, name="enc.pos")
    for i in range(layers):
        b.layer = i
        t = f"enc{i}"
        a = attention(f"{t}.attn", b.layer_norm(x, name=f"{t}.norm1"), None)
        x = b.add(x, a, name=f"{t}.res1")
        f = feed_forward(f"{t}.ffn", b.layer_norm(x, name=f"{t}.norm2"))
        x = b.add(x, f, name=f"{t}.res2")
    b.layer = None
    enc = x

    x = b.add(b.embedding(dec_ids, vocab, d_model, name="dec.embed"), pos, name="dec.pos")
    for i in range(layers):
        b.layer = layers + i
        t = f"dec{i}"
        a = attention(f"{t}.self", b.layer_norm(x, name=f"{t}.norm1"), None)
        x = b.add(x, a, name=f"{t}.res1")
        a = attention(f"{t}.cross", b.layer_norm(x, name=f"{t}.norm2"), enc)
        x = b.add(x, a, name=f"{t}.res2")
        f = feed_forward(f"{t}.ffn", b.layer_norm(x, name=f"{t}.norm3"))
        x = b.add(x, f, name=f"{t}.res3")
    b.layer = None
    logits = b.einsum("ble,ev->blv", x, (d_model, vocab), name="proj")
    b.softmax_xent(logits, name="loss")
    return b.build(pase_cutoff=1)
