"""Runs inside kvpress's own environment: the eval's prompts through kvpress's presses.

Started by `kvedit.harness.eval.reference` as `<kvpress venv>/bin/python kvpress_worker.py`
(kvpress pins a transformers that vLLM's cannot share, so this file imports nothing from
kvedit). It reads one JSON object on stdin and writes one JSON line per answer on stdout;
progress goes to stderr. No pickle: only JSON crosses the process boundary.

Input: {"model_dir", "threads", "deadline", "samples": [{"id", "context": [ids], "split": int,
"questions": [[ids], ...], "max_tokens"}], "arms": [{"press": class name | null,
"kwargs": {...}, "ratio": float, "question_in_context": bool}]}. For each sample and arm
it runs kvpress's own pipeline step (`KVPressTextGenerationPipeline._forward`): prefill the
context with the press, then answer each question greedily on the compressed cache. A
question-aware arm (SnapKV, TOVA: they score with the last tokens' queries) compresses the
context together with the question's first `split` tokens (the question text, without the
chat template's closing and the answer prime), as kvpress's evaluation does with
`compress_questions`, at the ratio that drops as many tokens as the arm's ratio drops of
the context alone. Its observation window is the question text (`window_size`
"question": the `split` tokens), the rows kvedit's SnapKV scores with too; kvpress's
default of 64 rows would be 9 question rows and 55 of the context's last sentences
(docs/eval.md, "kvpress's SnapKV at 4k").

Output lines: {"id", "arm", "answers": [text per question], "kept": [tokens per layer 0]}.

On a GPU (this interpreter's torch sees CUDA) the model runs there in bfloat16, as vLLM runs
it; on the CPU in float32. `deadline` (epoch seconds, or null): no sample starts that would
end past it, judged by the mean time of the samples done; a sample once started runs every
arm, so each sample in the output has all its arms.
"""
from __future__ import annotations

import json
import math
import sys
import time


def _arm(spec: dict, ratio: float, question: int):
    """The press of `spec` at `ratio`; a `window_size` of "question" becomes the question
    text's length (`question` tokens: the observation window is the question alone)."""
    import kvpress

    if spec["press"] is None:
        return None
    press = getattr(kvpress, spec["press"])
    kwargs = dict(spec.get("kwargs") or {})
    if kwargs.get("window_size") == "question":
        kwargs["window_size"] = max(1, question)
    inner = kwargs.pop("inner", None)
    if inner is not None:  # a wrapper press (AdaKVPress(SnapKVPress(...)))
        return press(getattr(kvpress, inner)(compression_ratio=ratio, **kwargs))
    return press(compression_ratio=ratio, **kwargs)


def main() -> int:
    job = json.loads(sys.stdin.read())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import kvpress  # noqa: F401  (registers the pipeline)
    from kvpress.pipeline import KVPressTextGenerationPipeline

    torch.set_num_threads(int(job.get("threads") or 1))
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        job["model_dir"], dtype=torch.bfloat16 if cuda else torch.float32).eval()
    if cuda:
        model = model.to("cuda")
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    t0 = time.time()
    deadline = job.get("deadline")
    for i, s in enumerate(job["samples"]):
        per = (time.time() - t0) / i if i else 0.0
        if deadline is not None and time.time() + per > deadline:
            print(f"kvpress: deadline, {i}/{len(job['samples'])} samples done",
                  file=sys.stderr, flush=True)
            break
        for a, spec in enumerate(job["arms"]):
            context, questions = list(s["context"]), [list(q) for q in s["questions"]]
            ratio = spec["ratio"]
            if spec.get("question_in_context"):
                # compressed: context + question text; kept out: template closing + prime
                drop = math.floor(ratio * len(context))
                context = context + questions[0][: s["split"]]
                questions = [q[s["split"]:] for q in questions[:1]]
                ratio = (drop - 0.5) / len(context)  # kvpress keeps int(n * (1 - ratio))
            press = _arm(spec, ratio, s["split"])
            cache = DynamicCache()
            with torch.no_grad():
                answers = pipe._forward(
                    {"context_ids": torch.tensor([context]),
                     "questions_ids": [torch.tensor([q]) for q in questions]},
                    max_new_tokens=s["max_tokens"], press=press, cache=cache)
            print(json.dumps({"id": s["id"], "arm": a, "answers": answers}), flush=True)
        print(f"kvpress: {i + 1}/{len(job['samples'])} samples, {time.time() - t0:.0f} s",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
