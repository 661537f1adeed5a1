# Loads an adapter loom wrote with Hugging Face PEFT (the independent reference) and checks that
# PEFT reads the same adapter: config fields, every tensor placed (no missing or unexpected key),
# each adapted Linear's output equal to loom's, and PEFT's merge equal to loom's merged model.
# Usage: peft_check.py ADAPTER_DIR IO_FILE MERGED_FILE   (files written by test_lora.cpp)
import json
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file

adapter_dir, io_file, merged_file = sys.argv[1:4]
io = load_file(io_file)
config = json.load(open(f"{adapter_dir}/adapter_config.json"))
adapted = sorted(k[len("x.") :] for k in io if k.startswith("x."))


def submodule(root, path):
    # Creates the containers along a dotted path, as the loom model names them.
    for part in path.split("."):
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    return root


def place(root, path, module):
    parent, _, leaf = path.rpartition(".")
    (submodule(root, parent) if parent else root).add_module(leaf, module)


# A base model of plain torch modules under loom's module names, with loom's base weights.
base = torch.nn.Module()
for name in adapted:
    weight = io[f"w.{name}.weight"]
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=f"w.{name}.bias" in io)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if linear.bias is not None:
            linear.bias.copy_(io[f"w.{name}.bias"])
    place(base, name, linear)
for name in config["modules_to_save"] or []:
    norm = torch.nn.LayerNorm(io[f"w.{name}.weight"].shape[0])
    with torch.no_grad():
        norm.weight.copy_(io[f"w.{name}.weight"])
        norm.bias.copy_(io[f"w.{name}.bias"])
    place(base, name, norm)

with torch.no_grad():
    reference = {name: base.get_submodule(name)(io[f"x.{name}"]) for name in adapted}
# PEFT warns (not fails) on missing/unexpected keys, so count them through the load result.
model = PeftModel.from_pretrained(base, adapter_dir)
model.eval()
loaded = model.peft_config["default"]
assert loaded.peft_type.value == "LORA", loaded.peft_type
for key in ("r", "lora_alpha", "use_rslora", "bias", "lora_dropout", "fan_in_fan_out"):
    assert getattr(loaded, key) == config[key], (key, getattr(loaded, key), config[key])

from peft.utils import load_peft_weights, set_peft_model_state_dict  # noqa: E402

result = set_peft_model_state_dict(model, load_peft_weights(adapter_dir))
assert not result.unexpected_keys, f"PEFT did not place: {result.unexpected_keys}"
missing = [k for k in result.missing_keys if "lora_" in k]
assert not missing, f"PEFT found no value for: {missing}"

worst = 0.0
with torch.no_grad():
    for name in adapted:
        module = model.base_model.model.get_submodule(name)
        assert hasattr(module, "lora_A"), f"PEFT put no LoRA layer on {name}"
        out = module(io[f"x.{name}"])
        expect = io[f"y.{name}"]
        worst = max(worst, (out - expect).abs().max().item())
        # The adapter really contributes: loom's output is not the base output.
        assert (expect - reference[name]).abs().max().item() > 1e-4, name
    assert worst < 1e-5, f"PEFT's outputs differ from loom's by {worst}"
    for name in config["modules_to_save"] or []:
        wrapper = model.base_model.model.get_submodule(name)
        saved = load_peft_weights(adapter_dir)
        for param in ("weight", "bias"):
            got = wrapper.modules_to_save["default"].get_parameter(param)
            assert torch.equal(got, saved[f"base_model.model.{name}.{param}"]), (name, param)

    merged = load_file(merged_file)
    plain = model.merge_and_unload()
    merge_worst = 0.0
    for name in adapted:
        merge_worst = max(merge_worst, (plain.get_submodule(name).weight - merged[f"{name}.weight"]).abs().max().item())
    assert merge_worst < 1e-6, f"PEFT's merged weights differ from loom's by {merge_worst}"
print(f"ok: {len(adapted)} adapted Linears, max output difference {worst:.2e}, "
      f"max merged-weight difference {merge_worst:.2e}")
