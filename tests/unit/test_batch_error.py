"""A batch whose streams fail alike (an engine that died: 64 identical HTTP 500s) reads as
one line per distinct reason, naming how many streams and which."""
from types import SimpleNamespace

from kvedit.sdk.errors import BatchError, CompletionError, ModifyError


def stream(i: int):
    return SimpleNamespace(label=f"stream-{i}")


def test_identical_failures_are_one_line_each_distinct_one_its_own():
    errors = [CompletionError(stream(i), "HTTP 500: EngineDeadError") for i in range(64)]
    errors.insert(5, ModifyError(stream(99), "no captured queries"))
    errors.append(ValueError("not a stream's"))
    e = BatchError("decode", errors, 80)
    lines = str(e).splitlines()
    assert lines[0] == "decode failed for 66 of 80 streams:"
    assert lines[1] == ("  - 64 streams (stream-0, stream-1, stream-2, ...): "
                        "HTTP 500: EngineDeadError")
    assert lines[2] == "  - stream-99: no captured queries"
    assert lines[3] == "  - not a stream's"
    assert len(lines) == 4 and e.errors == errors   # every error is still there to inspect


def test_the_same_reason_of_another_kind_is_not_merged():
    e = BatchError("modify", [CompletionError(stream(0), "x"), ModifyError(stream(1), "x"),
                              ModifyError(stream(2), "x")], 3)
    assert str(e).splitlines()[1:] == ["  - stream-0: x", "  - 2 streams (stream-1, stream-2): x"]
