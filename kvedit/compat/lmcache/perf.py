"""StreamPerfMetrics: what one request of one stream took (LMCache SDK 0.5.x's dataclass)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StreamPerfMetrics:
    """One generate() of one stream. Times in seconds, from calling post_completion to its
    last token; `ttft` to the first token, `tpot` the gaps between later tokens."""

    duration: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    input_tput: float = 0.0
    output_tput: float = 0.0
    tpot: list[float] = field(default_factory=list)
    ttft: float = 0.0

    @classmethod
    def of(cls, start: float, stamps: list[float], end: float, input_tokens: int,
           output_tokens: int) -> StreamPerfMetrics:
        """From the call's start, each token's arrival time and its end (perf_counter)."""
        duration = end - start
        gaps = [b - a for a, b in zip([start, *stamps], stamps)]
        return cls(duration=duration, input_tokens=input_tokens, output_tokens=output_tokens,
                   input_tput=input_tokens / duration if duration > 0 else 0.0,
                   output_tput=output_tokens / duration if duration > 0 else 0.0,
                   tpot=gaps[1:], ttft=gaps[0] if gaps else 0.0)
