"""transformers' and PEFT's side of the llama plugin's tests (test_llama_hf.cpp): the
independent reference. usage:
  llama_hf.py make DIR [FLAG...]       a random LlamaForCausalLM saved with save_pretrained, and
                                       DIR/ref.safetensors: input_ids and its logits. FLAGs:
                                       tied, mha (no grouped-query attention), bias, sharded,
                                       rope=linear|dynamic|llama3
  llama_hf.py logits DIR IDS OUT       logits of DIR (from_pretrained) for IDS' input_ids
  llama_hf.py train DIR BATCHES OUT    5 steps of torch AdamW on BATCHES from DIR: the losses
  llama_hf.py generate DIR IDS N OUT   greedy generate() of N new tokens after IDS' input_ids
  llama_hf.py peft BASE ADAPTER IDS OUT  PEFT's PeftModel of BASE with loom's ADAPTER: every
                                       adapter tensor placed; its logits for IDS
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
mode, folder = sys.argv[1], sys.argv[2]
if mode == "make":
    flags = sys.argv[3:]
    rope = {"rope_type": "default", "rope_theta": 500.0}
    positions = 32
    for flag in flags:
        if flag.startswith("rope="):
            kind = flag[5:]
            rope = {"rope_type": kind, "rope_theta": 500.0, "factor": 4.0}
            if kind == "llama3":
                rope.update(low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8)
            if kind == "dynamic":
                positions = 8  # the 16-token input is longer: the base is raised
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4,
                         num_key_value_heads=4 if "mha" in flags else 2,
                         max_position_embeddings=positions, rms_norm_eps=1e-5,
                         rope_parameters=rope, attention_bias="bias" in flags,
                         mlp_bias="bias" in flags, tie_word_embeddings="tied" in flags,
                         initializer_range=0.1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms and biases away from their 1/0 start, so a swap shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, max_shard_size="40KB" if "sharded" in flags else "5GB")
    ids = (torch.arange(32) * 7 % 96).view(2, 16)
    with torch.no_grad():
        logits = model(ids).logits
    save_file({"input_ids": ids, "logits": logits.contiguous()}, f"{folder}/ref.safetensors")
elif mode == "logits":
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    ids = load_file(sys.argv[3])["input_ids"]
    with torch.no_grad():
        save_file({"logits": model(ids).logits.contiguous()}, sys.argv[4])
elif mode == "train":
    model = LlamaForCausalLM.from_pretrained(folder).train()
    batches = load_file(sys.argv[3])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    losses = []
    for step in range(5):
        ids, labels = batches[f"input_ids.{step}"], batches[f"labels.{step}"]
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(),
                                                 labels.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    save_file({"losses": torch.stack(losses).double()}, sys.argv[4])
elif mode == "generate":
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    ids, n = load_file(sys.argv[3])["input_ids"], int(sys.argv[4])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        # Greedy steps whose top two logits are this close could flip on rounding alone.
        scores = model(out).logits[0, ids.size(1) - 1:-1]
        top2 = scores.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4, "a near tie: the test is not sharp"
    save_file({"ids": out[0].contiguous()}, sys.argv[5])
elif mode == "peft":
    from peft import PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict
    base = LlamaForCausalLM.from_pretrained(folder).eval()
    model = PeftModel.from_pretrained(base, sys.argv[3]).eval()
    result = set_peft_model_state_dict(model, load_peft_weights(sys.argv[3]))
    assert not result.unexpected_keys, f"PEFT did not place: {result.unexpected_keys}"
    missing = [k for k in result.missing_keys if "lora_" in k]
    assert not missing, f"PEFT found no loom tensor for: {missing}"
    ids = load_file(sys.argv[4])["input_ids"]
    with torch.no_grad():
        save_file({"logits": model(ids).logits.contiguous()}, sys.argv[5])
