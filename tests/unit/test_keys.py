"""kvedit.keys: the prefix-hash chain, deterministic across processes, namespaced."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvedit.keys import KEY_BYTES, chunk_keys, namespace, request_keys
from kvedit.layout import ModelLayout

LAY = ModelLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_size=4)
TOKENS = list(range(100, 118))  # 4 full chunks of 4 + 2 tokens


def test_full_chunks_only_and_prefix_chain():
    ks = request_keys("m", LAY, TOKENS)
    assert len(ks) == 4 and all(len(k) == KEY_BYTES for k in ks)
    assert len(set(ks)) == 4
    # a shared prefix gives the same leading keys; a change in chunk 2 changes keys 2..
    other = TOKENS[:9] + [7] + TOKENS[10:]
    ko = request_keys("m", LAY, other)
    assert ko[:2] == ks[:2] and ko[2] != ks[2] and ko[3] != ks[3]
    assert request_keys("m", LAY, TOKENS[:3]) == []
    assert chunk_keys(np.array(TOKENS), 4, namespace("m", LAY), max_chunks=2) == ks[:2]


@pytest.mark.parametrize("change", [
    dict(model="m2"), dict(salt="s"), dict(layout=dict(dtype="float16")),
    dict(layout=dict(tp_rank=1, tp_size=2)), dict(layout=dict(num_layers=5)),
])
def test_namespace_separates(change):
    lay = LAY
    if "layout" in change:
        lay = ModelLayout(**{**{f: getattr(LAY, f) for f in LAY.__struct_fields__},
                             **change["layout"]})
    ks = request_keys(change.get("model", "m"), lay, TOKENS, change.get("salt", ""))
    assert not set(ks) & set(request_keys("m", LAY, TOKENS))


def test_deterministic_across_processes():
    code = ("from kvedit.keys import request_keys; from kvedit.layout import ModelLayout; "
            "lay = ModelLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype='bfloat16', "
            f"chunk_size=4); print(b''.join(request_keys('m', lay, {TOKENS!r}, 'salt')).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout
            .strip() for seed in (1, 2)}
    assert outs == {b"".join(request_keys("m", LAY, TOKENS, "salt")).hex()}


def test_bad_tokens():
    with pytest.raises(ValueError, match="token ids"):
        request_keys("m", LAY, [1, 2, -3, 4])
    with pytest.raises(ValueError, match="token ids"):
        request_keys("m", LAY, [2**32, 1, 2, 3])


def test_lists_arrays_and_extension_give_the_same_keys():
    """The list path (array('I'), what vLLM hands the connector) and the numpy path agree,
    with the chain written out by hand; extending known leading keys gives the whole chain."""
    import hashlib

    rng = np.random.default_rng(0)
    toks = rng.integers(0, 2**32, size=4 * 9 + 3, dtype=np.int64)
    ns = namespace("m", LAY)
    prev, want = ns, []
    for i in range(9):
        prev = hashlib.blake2b(prev + toks[4 * i:4 * i + 4].astype("<u4").tobytes(),
                               digest_size=KEY_BYTES).digest()
        want.append(prev)
    assert chunk_keys(toks.tolist(), 4, ns) == chunk_keys(toks, 4, ns) == want
    assert chunk_keys(tuple(toks.tolist()), 4, ns, max_chunks=5) == want[:5]
    for have in (0, 1, 5, 9):
        assert chunk_keys(toks.tolist(), 4, ns, known=want[:have]) == want
    assert chunk_keys(toks.tolist()[:20], 4, ns, known=want) == want[:5]  # fewer tokens now
    assert request_keys("m", LAY, toks.tolist()) == want
    with pytest.raises(ValueError, match="token ids"):
        chunk_keys([1, 2, 3, 4.5], 4, ns)
