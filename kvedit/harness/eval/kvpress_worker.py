"""Runs inside kvpress's own environment: the eval's prompts through kvpress's presses.

Started by `kvedit.harness.eval.reference` as `<kvpress venv>/bin/python kvpress_worker.py`
(kvpress pins a transformers that vLLM's cannot share, so this file imports nothing from
kvedit). It reads one JSON object on stdin and writes one JSON line per answer on stdout;
progress goes to stderr. No pickle: only JSON crosses the process boundary.

Input: {"model_dir", "threads", "deadline", "alone", "samples": [{"id", "context": [ids], "split": int,
"questions": [[ids], ...], "max_tokens"}], "arms": [{"press": class name | null,
"kwargs": {...}, "ratio": float, "question_in_context": bool}]}. For each sample every arm
answers the first question greedily on its compressed cache, as kvpress's pipeline step
(`KVPressTextGenerationPipeline._forward`) would: the presses of a sample share one prefill
(two with question-aware arms) and their answers decode in batches (kvpress_shared.py, which
says why that is the same); a press that cannot share runs kvpress's pipeline alone. A
question-aware arm (SnapKV, TOVA: they score with the last tokens' queries) compresses the
context together with the question's first `split` tokens (the question text, without the
chat template's closing and the answer prime), as kvpress's evaluation does with
`compress_questions`, at the ratio that drops as many tokens as the arm's ratio drops of
the context alone. Its observation window is the question text (`window_size` "question":
the `split` tokens), the rows kvedit's SnapKV scores with too; kvpress's default of 64 rows
would be 9 question rows and 55 of the context's last sentences (docs/eval.md, "kvpress's
SnapKV at 4k").

Output lines: {"id", "arm", "answers": [text]}.

On a GPU (this interpreter's torch sees CUDA) the model runs there in bfloat16, as vLLM runs
it; on the CPU in float32. `deadline` (epoch seconds, or null): no sample starts that would
end past it, judged by the mean time of the samples done; a sample once started runs every
arm, so each sample in the output has all its arms.
"""
from __future__ import annotations

import json
import sys
import time


def _sample(pipe, s: dict, arms: list[dict], alone: bool) -> list[tuple[int, str]]:
    """(arm index, answer) of every arm on sample `s` (module docstring); `alone`: every
    press through kvpress's pipeline on its own prefill (the reference the shared path is
    checked against)."""
    import torch
    from transformers import DynamicCache

    import kvpress_shared as K

    model, tok = pipe.model, pipe.tokenizer
    context, question, split = list(s["context"]), list(s["questions"][0]), s["split"]
    out = []
    for aware in (False, True):
        mine = [(a, spec) for a, spec in enumerate(arms)
                if bool(spec.get("question_in_context")) == aware]
        presses = [(a, K.press_of(spec, K.arm_ratio(spec, len(context), split), split))
                   for a, spec in mine]
        solo = [(a, p) for a, p in presses if alone or not K.shareable(p)]
        shared = [(a, p) for a, p in presses if not alone and K.shareable(p)]
        ids = context + question[:split] if aware else context
        asked = question[split:] if aware else question
        for a, press in solo:   # kvpress's own pipeline step, this press alone
            with torch.no_grad():
                text = pipe._forward({"context_ids": torch.tensor([ids]),
                                      "questions_ids": [torch.tensor([asked])]},
                                     max_new_tokens=s["max_tokens"], press=press,
                                     cache=DynamicCache())[0]
            out.append((a, text))
        if not shared:
            continue
        zips = [p.n_sink for _, p in shared if isinstance(p, K.KVzipPress)]
        pre = K.Prefill(model, ids, kvzip_sink=zips[0] if zips else None)
        by_length: dict[int, list] = {}
        for a, press in shared:
            kv, masks = pre.arm(press)
            by_length.setdefault(kv[0][0].shape[2], []).append((a, (kv, masks)))
        for rows in by_length.values():
            texts = K.answer(model, tok, [r for _, r in rows], asked, len(ids), s["max_tokens"])
            out += [(a, t) for (a, _), t in zip(rows, texts)]
    return sorted(out)


def main() -> int:
    job = json.loads(sys.stdin.read())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        for a, text in _sample(pipe, s, job["arms"], bool(job.get("alone"))):
            print(json.dumps({"id": s["id"], "arm": a, "answers": [text]}), flush=True)
        print(f"kvpress: {i + 1}/{len(job['samples'])} samples, {time.time() - t0:.0f} s",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
