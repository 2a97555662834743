"""What query capture relies on in vLLM, read from a release's source (AST and text, no
import), so tests/unit/vllm_hook_shapes.json records it per release and the unit tests check
the hook against every recorded shape. Regenerate (each DIR an unpacked wheel, named by its
version):

  python -m tests.unit.vllm_hook_shapes DIR... > tests/unit/vllm_hook_shapes.json
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

IMPLS = {"flash_attn": "FlashAttentionImpl", "flashinfer": "FlashInferImpl",
         "triton_attn": "TritonAttentionImpl", "cpu_attn": "CPUAttentionBackendImpl"}


def _params(tree: ast.AST, cls: str) -> list[str] | None:
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef) and n.name == cls:
            for f in n.body:
                if isinstance(f, ast.FunctionDef) and f.name == "forward":
                    a = f.args
                    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return None


def shapes(root: Path) -> dict:
    def text(rel: str) -> str:
        p = root / "vllm" / rel
        return p.read_text() if p.exists() else ""

    out: dict = {"impl_forward": {
        cls: _params(ast.parse(text(f"v1/attention/backends/{mod}.py")), cls)
        for mod, cls in IMPLS.items()}}
    att = text("model_executor/layers/attention/attention.py")
    op = att[att.find("def unified_attention_with_output("):]
    op = op[:op.find("\ndef ", 10)]
    # the attention op looks the impl up on the layer at call time (a per-instance shadow works)
    out["op_calls_layer_impl_forward"] = "self.impl.forward(" in op
    out["op_is_a_splitting_op"] = '"vllm::unified_attention_with_output"' in text(
        "config/compilation.py")
    fc = text("forward_context.py")
    out["forward_context_slot_mapping_per_layer"] = "slot_mapping: dict[str, torch.Tensor]" in fc
    out["forward_context_available_fn"] = "def is_forward_context_available" in fc
    mix = text("v1/worker/kv_connector_model_runner_mixin.py")
    bind = mix.find("kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)")
    out["v1_runner_binds_before_forward"] = 0 < bind < mix.find("yield output")
    v2 = text("v1/worker/gpu/model_runner.py")
    full = v2[v2.find("if batch_desc.cg_mode == CUDAGraphMode.FULL:"):]
    out["v2_runner_full_graph_binds_outside_forward_context"] = \
        full.find("pre_forward(") < full.find("set_forward_context(")
    sched = text("v1/core/sched/scheduler.py")
    out["scheduler_calls_on_new_request"] = "self.connector.on_new_request(request)" in sched
    out["scheduler_drops_external_hits_of_skip_reading"] = bool(re.search(
        r"get_num_new_matched_tokens\([^)]*\)\s*\)\s*if request\.skip_reading_prefix_cache:",
        sched))
    req = text("v1/request.py")
    out["request_kv_transfer_params_from_extra_args"] = bool(re.search(
        r"self\.kv_transfer_params = sampling_params\.extra_args\.get\(\s*\"kv_transfer_params\"",
        req))
    out["request_skip_reading_prefix_cache"] = "self.skip_reading_prefix_cache = " in req
    out["cache_manager_honours_skip_reading"] = "request.skip_reading_prefix_cache" in text(
        "v1/core/kv_cache_manager.py")
    out["openai_kv_transfer_params_to_extra_args"] = \
        'extra_args["kv_transfer_params"] = self.kv_transfer_params' in text(
            "entrypoints/openai/completion/protocol.py")
    return out


if __name__ == "__main__":
    print(json.dumps({Path(d).name: shapes(Path(d)) for d in sys.argv[1:]}, indent=1))
