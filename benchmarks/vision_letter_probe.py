"""The vision job's RL signal on the answer letter alone, in-process and fast: which settings let GRPO learn at all.

    .venv/bin/python benchmarks/vision_letter_probe.py                               # warm-up trains the tower
    .venv/bin/python benchmarks/vision_letter_probe.py --freeze-vision-warmup        # the job's setting
    .venv/bin/python benchmarks/vision_letter_probe.py --freeze-vision-warmup --blank
    .venv/bin/python benchmarks/vision_letter_probe.py --mode sft --warmup 0         # supervised, for scale

The embedded job (configs/vision_tiny_cpu.yaml) answers `<think></think>\\boxed{X}`; after its format warm-up every
token but X is near-deterministic, so its learning is the learning of X. This probe keeps only that: the same
random-init tiny Qwen3-VL and processor, the prompt with `<think></think>\\boxed{` appended (teacher-forced), and the
policy is the model's distribution over the whole vocabulary at the next token. Warm-up: `--warmup` steps of
cross-entropy on a random letter per prompt (what the job's format warm-up does to X), optionally with the vision
tower frozen. Then `--steps` GRPO steps: `--prompts` prompts x `--group` sampled letters, reward 1 for the right one,
advantages normalised per group, AdamW. No Ray, no generation, ~0.1 s a step on 2 CPU cores; held-out greedy accuracy
every 10 steps on 128 problems. It does not replace the job (benchmarks/vision_learning.py): it ranks settings.
Last line: one JSON object with the run's settings and its accuracy curve.
"""

import argparse
import json
import random
import time

import torch

from miles_vl.config.schema import DataConfig
from miles_vl.data import PromptEncoder, generate_problems, load_processor
from miles_vl.models.qwen3_vl.model import build_model
from miles_vl.models.qwen3_vl.tokens import special_tokens

ap = argparse.ArgumentParser()
ap.add_argument("--task", default="background_colour")
ap.add_argument("--px", type=int, default=224)
ap.add_argument("--instruction", default="default")
ap.add_argument("--warmup", type=int, default=20)
ap.add_argument("--warmup-lr", type=float, default=1e-2)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--group", type=int, default=8)
ap.add_argument("--mode", default="rl", choices=["rl", "sft"])
ap.add_argument("--seed", type=int, default=1234)
ap.add_argument("--blank", action="store_true")
ap.add_argument("--wd", type=float, default=0.0)
ap.add_argument("--hidden", type=int, default=64)
ap.add_argument("--freeze-vision-warmup", action="store_true")
ap.add_argument("--warmup-uniform", action="store_true", help="warm-up target: the uniform distribution over letters")
args = ap.parse_args()
torch.manual_seed(args.seed)
random.seed(args.seed)
torch.set_num_threads(2)

px = args.px * args.px
proc = load_processor("offline", px, px)
tok = special_tokens(proc)
instr = {"default": DataConfig.model_fields["instruction"].default, "none": None}[args.instruction]  # the job's default
enc = PromptEncoder(proc, instruction=instr)
model = build_model(tok, seed=args.seed, tiny={"hidden_size": args.hidden} if args.hidden != 64 else None)
model.train()
letters = ["A", "B", "C", "D"]
letter_ids = [proc.tokenizer.encode(x, add_special_tokens=False)[-1] for x in letters]

probs = generate_problems(640, seed=args.seed, task=args.task)
prefix = "<think></think>\\boxed{"


def encode(p):
    text = enc.render(p.problem) + prefix
    img = p.image
    if args.blank:
        from PIL import Image

        img = Image.new("RGB", img.size, "white")
    out = proc(text=[text], images=[img], return_tensors="pt")
    return (
        out["input_ids"][0],
        out["pixel_values"],
        out["image_grid_thw"],
        letters.index(p.answer),
        out["mm_token_type_ids"][0],
    )


data = [encode(p) for p in probs]
train, evals = data[:512], data[512:]
print("prompt tokens", len(train[0][0]), "image tokens", int((train[0][0] == tok.image_token_id).sum()), flush=True)


def last_logits(batch):
    L = max(len(b[0]) for b in batch)
    ids = torch.full((len(batch), L), proc.tokenizer.pad_token_id or 0)
    att = torch.zeros((len(batch), L), dtype=torch.long)
    tt = torch.zeros((len(batch), L), dtype=torch.long)
    for i, b in enumerate(batch):  # left pad
        ids[i, L - len(b[0]) :] = b[0]
        att[i, L - len(b[0]) :] = 1
        tt[i, L - len(b[0]) :] = b[4]
    pv = torch.cat([b[1] for b in batch])
    grid = torch.cat([b[2] for b in batch])
    out = model(input_ids=ids, attention_mask=att, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=tt)
    return out.logits[:, -1].float()


def evaluate():
    model.eval()
    correct = 0
    preds = []
    with torch.no_grad():
        for i in range(0, len(evals), 32):
            b = evals[i : i + 32]
            lg = last_logits(b)
            pred = lg.argmax(-1)
            for j, x in enumerate(b):
                preds.append(int(pred[j]))
                correct += int(pred[j]) == letter_ids[x[3]]
    model.train()
    return correct / len(evals), len(set(preds))


opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=args.wd)
rng = random.Random(args.seed)
t0 = time.time()
if args.freeze_vision_warmup:
    for p_ in model.model.visual.parameters():
        p_.requires_grad_(False)
for _ in range(args.warmup):
    b = rng.sample(train, args.prompts)
    lg = last_logits(b)
    if args.warmup_uniform:
        loss = -torch.log_softmax(lg, -1)[:, letter_ids].mean()
    else:
        tgt = torch.tensor([letter_ids[rng.randrange(4)] for _ in b])
        loss = torch.nn.functional.cross_entropy(lg, tgt)
    opt.zero_grad()
    loss.backward()
    opt.step()
for g in opt.param_groups:
    g["lr"] = args.lr
for p_ in model.parameters():
    p_.requires_grad_(True)
acc, nd = evaluate()
print(json.dumps({"step": 0, "eval": acc, "distinct": nd, "t": round(time.time() - t0, 1)}), flush=True)
curve = [[0, acc]]
hist = []
for s in range(1, args.steps + 1):
    b = rng.sample(train, args.prompts)
    lg = last_logits(b)
    logp = torch.log_softmax(lg, -1)
    if args.mode == "sft":
        loss = -logp[torch.arange(len(b)), torch.tensor([letter_ids[x[3]] for x in b])].mean()
        r_mean = float(torch.exp(-loss.detach()))
    else:
        acts = torch.multinomial(logp.exp(), args.group, replacement=True)  # [B, G]
        r = torch.stack([(acts[i] == letter_ids[x[3]]).float() for i, x in enumerate(b)])
        adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
        loss = -(adv * logp.gather(1, acts)).mean()
        r_mean = float(r.mean())
    opt.zero_grad()
    loss.backward()
    opt.step()
    hist.append(r_mean)
    if s % 10 == 0:
        acc, nd = evaluate()
        curve.append([s, acc])
        print(json.dumps({"step": s, "eval": acc, "distinct": nd, "train_r": round(sum(hist[-10:]) / 10, 3),
                          "t": round(time.time() - t0, 1)}), flush=True)  # fmt: skip
print(json.dumps({"benchmark": "vision_letter_probe", "settings": vars(args), "chance": 0.25, "eval": curve}))
