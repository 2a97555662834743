"""The eval's --policies vocabulary: a policy spec (`name:option=value`), its result label,
the header sink, and what a set of policies needs from the prefill (captured queries, KVzip's
reconstruction pass)."""
from __future__ import annotations


def parse_spec(spec: str) -> tuple[str, dict]:
    """A --policies entry: a registry name, optionally with dataclass options
    (`snapkv:per_head=off:positions=compact`) -> (name, options)."""
    from dataclasses import fields

    from kvedit.edits import POLICIES

    name, *opts = spec.split(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}")
    known = {f.name: f for f in fields(POLICIES[name])}
    out: dict = {}
    for opt in opts:
        key, eq, text = opt.partition("=")
        if not eq or key not in known or key in ("ratio", "granularity"):
            raise ValueError(f"{spec!r}: {opt!r} is not option=value of {POLICIES[name].__name__}"
                             f" (options: {sorted(set(known) - {'ratio', 'granularity'})})")
        out[key] = _value(text)
    return name, out


def _value(text: str):
    low = text.lower()
    if low in ("on", "true", "yes"):
        return True
    if low in ("off", "false", "no"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def label(spec: str) -> str:
    """How results name a --policies entry: the class name and its options."""
    from kvedit.edits import POLICIES

    name, opts = parse_spec(spec)
    return POLICIES[name].__name__ + "".join(f":{k}={v}" for k, v in opts.items())


def sink_policies() -> list[str]:
    """Registry names of the policies that have a `sink` option (keep the first n tokens)."""
    from dataclasses import fields

    from kvedit.edits import POLICIES

    return [k for k, cls in POLICIES.items() if any(f.name == "sink" for f in fields(cls))]


def header_sink(samples, keep_header: bool) -> int | None:
    """The `sink` the eval gives policies that have one: the header's token count, which
    every sample of a suite shares (one template, one instruction); None: policy defaults."""
    if not keep_header:
        return None
    sizes = {s.header for s in samples}
    if len(sizes) != 1 or not min(sizes):
        raise ValueError(f"the samples' header lengths differ or are unknown ({sorted(sizes)}): "
                         "one sink cannot protect them all")
    return sizes.pop()


def make_policy(name: str, ratio: float, granularity: str, sink: int | None = None, *,
                per_head: bool | None = None, positions: str | None = None):
    """POLICIES[name] at `ratio` (`name` may carry options, parse_spec); `sink` (the header,
    see header_sink) to those that have one; `per_head` and `positions` override the
    policy's defaults when given; the name's own options override all."""
    from kvedit.harness.vocab import policy

    name, opts = parse_spec(name)
    kw: dict = {}
    if per_head is not None:
        kw["per_head"] = per_head
    if positions is not None:
        kw["positions"] = positions
    return policy(name, ratio=ratio, granularity=granularity, sink=sink, **{**kw, **opts})


def sources(policies: list[str]) -> set[str]:
    """Where the policies' queries come from (`DropPolicy.queries_from` of each, as built
    with its options: a head-adaptive budget makes a query-free policy want the context's)."""
    out = set()
    for spec in policies:
        pol = make_policy(spec, 0.5, "token")
        if pol.needs_queries:
            out.add(getattr(pol, "queries_from", None) or "prompt")
    return out


def needs_queries(policies: list[str]) -> bool:
    """Some policy scores from the prompt's captured queries: the prefills must capture
    them."""
    return "prompt" in sources(policies)


def needs_reconstruction(policies: list[str]) -> bool:
    """Some policy scores from KVzip's reconstruction pass: run it once per sample."""
    return "reconstruction" in sources(policies)


def needs_context(policies: list[str]) -> bool:
    """Some policy scores with the context's own queries (Expected Attention, a head-adaptive
    budget's null keys): run the context pass once per sample."""
    return "context" in sources(policies)


def query_aware(policy_label: str) -> bool:
    """Whether the policy (a result's label, `label`) scores with the question's queries."""
    from kvedit.edits import POLICIES

    name = policy_label.split(":")[0]
    cls = next(c for c in POLICIES.values() if c.__name__ == name)
    return cls.needs_queries and cls.queries_from == "prompt"


def reconstruction_for(tok):
    """KVzip's pass for the eval's prompts: the paper's repeat prompt closed by the chat
    template's end of user turn and assistant opening, repeating the context from after the
    template's opening (as kvpress)."""
    from kvedit.harness.eval.runner import Reconstruction
    from kvedit.sdk.kvzip import REPEAT_PROMPT

    return Reconstruction(tok.encode(REPEAT_PROMPT + tok.after_user),
                          len(tok.encode(tok.before_user)))
