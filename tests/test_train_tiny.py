"""The training script end to end at micro scale on CPU: tokenizer, target (both curriculum
stages), draft by distillation with the target's frozen trunk, export; the result loads in
transformers and in our engine, which detects the shared trunk."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from docproc import LLM, SamplingParams
from docproc.pipeline.queries import build_prompt

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tiny.py"), *map(str, args)], check=True,
                   cwd=ROOT, capture_output=True, timeout=600)


def test_micro_training_pipeline(tmp_path):
    work, dest = tmp_path / "work", tmp_path / "models"
    common = ["--work", work, "--micro", "--batch", "2", "--workers", "0", "--eval-every", "2"]
    run("tokenizer", "--work", work, "--micro")
    tok = json.loads((work / "tokenizer" / "tokenizer_config.json").read_text())
    assert "<|image_pad|>" in json.dumps(tok)
    run("target", *common, "--max-steps", "4", "--line-steps", "2")
    state = json.loads((work / "target_state.json").read_text())
    assert state["step"] == 4 and {e["stage"] for e in state["log"]} == {"lines", "pages"}
    run("target", *common, "--max-steps", "6", "--line-steps", "2")  # resumes from the checkpoint
    assert json.loads((work / "target_state.json").read_text())["step"] == 6
    run("draft", *common, "--max-steps", "2")
    run("export", "--work", work, "--to", dest)
    from transformers import Qwen2VLForConditionalGeneration

    for role in ("target", "draft"):
        m = Qwen2VLForConditionalGeneration.from_pretrained(str(dest / role))
        assert m.dtype == torch.bfloat16 or m.dtype == torch.float32
        assert all(f.stat().st_size < 16 << 20 for f in (dest / role).glob("*.safetensors"))
    t = {k: v for k, v in Qwen2VLForConditionalGeneration.from_pretrained(str(dest / "target")).model.visual
         .state_dict().items() if not k.startswith("merger.")}
    d = Qwen2VLForConditionalGeneration.from_pretrained(str(dest / "draft")).model.visual.state_dict()
    assert all(torch.equal(v, d[k]) for k, v in t.items())  # the draft's trunk is the target's
    llm = LLM(str(dest / "target"), device="cpu", speculative_model=str(dest / "draft"), num_speculative_tokens=2)
    from PIL import Image

    out = llm.generate([{"prompt": build_prompt(1, "What is the total?"),
                         "multi_modal_data": {"image": [Image.new("RGB", (200, 260), "white")]}}],
                       SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and llm.spec_info()["shared_vision_trunk"]
