"""The cases of bench/gpu_correctness.py: each runs a public op with ``backend="triton"`` on fresh random
inputs and measures its error, forward and gradients, against its float64 reference ``*_ref`` from
``kernels/reference.py`` fed the same rounded inputs (and the same rounded upstream gradients).

`RUNNERS` maps a plan's ``Case.run`` to its function; each takes (torch, device, sizes, params, seed)
and returns (shape text, {part: err}, dtype name, note, {part: plain float32 err}); parts are judged by
`gpu_correctness_plan.bar(part, dtype, plain)`. The log-prob cases also run their reference in plain
float32 on the same rounded inputs (IEEE cuBLAS, dense logits) and report its error: the bar of a
part that plain float32 arithmetic cannot meet either is set by it. The error measures are defined in that module's
docstring. Inputs are agent-shaped forests (`gpu_forests.Forest`).
"""

from __future__ import annotations

import math

from gpu_forests import Forest

# --------------------------------------------------------------------------------------- errors


def _finite(torch, a) -> bool:
    return bool(torch.isfinite(a).all())


def rel_err(torch, actual, expected, scale: float = 0.0) -> float:
    """max |a - e| / max(max |e|, scale) (inf when ``actual`` holds a NaN or inf). `scale`: the size
    of the terms a reduced value sums, where they may cancel (then max |e| says nothing of rounding)."""
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    if e.numel() == 0:
        return 0.0 if a.numel() == 0 else math.inf
    if a.shape != e.shape or not _finite(torch, a):
        return math.inf
    return float((a - e).abs().max() / e.abs().max().clamp(min=max(scale, 1e-30)))


def unit_err(torch, actual, expected) -> float:
    """max |a - e| / max(max |e|, 1): attention's error (exact zeros of a gradient divide by 1)."""
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    if a.shape != e.shape or not _finite(torch, a):
        return math.inf
    return float((a - e).abs().max() / e.abs().max().clamp(min=1.0))


def metric_err(actual: float, expected: float) -> float:
    if not math.isfinite(actual):
        return math.inf
    return abs(actual - expected) / max(abs(expected), 0.1)


def metrics_err(got: dict, want: dict) -> float:
    if set(got) != set(want):
        return math.inf
    return max((metric_err(got[k], want[k]) for k in want), default=0.0)


# ----------------------------------------------------------------------------------------- cases


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def _randn(torch, gen, device, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64, device=device)


def _generator(torch, device, seed: int):
    return torch.Generator(device=device).manual_seed(seed)


class NeedsGPU(Exception):
    """A case whose op runs on CUDA alone: on a CPU (a smoke run) its row says so, neither ok nor failed."""


def case_attention(torch, device, sizes, params, seed):
    from clawfast.kernels import TreeMask, tree_attention, tree_attention_ref

    backend = params.get("backend", "triton")
    if backend == "varlen" and device == "cpu":
        raise NeedsGPU("backend 'varlen' is flash-attention's CUDA kernel")
    dtype = getattr(torch, params["dtype"])
    n, hq, hkv, d = sizes["rows"], sizes["hq"], sizes["hkv"], sizes["head_dim"]
    forest = Forest(n, samples=8 if n >= 256 else 3, rng=_rng(seed))
    kv_end = torch.tensor(forest.kv_end, dtype=torch.int32, device=device)
    depth = forest.depth()
    gen = _generator(torch, device, seed)
    q, k, v, g_out = (_randn(torch, gen, device, n, h, d).to(dtype) for h in (hq, hkv, hkv, hq))
    inputs = [q, k, v]
    options = {}
    if params.get("window"):
        options["window"] = max(2, depth // 4)  # shorter than the long paths, longer than the short ones
    if params.get("softcap"):
        options["softcap"] = params["softcap"]
    if params.get("dropout_p"):
        options.update(dropout_p=params["dropout_p"], seed=seed % 2**31)
    sinks = None
    if params.get("sinks"):
        sinks = (_randn(torch, gen, device, hq) + 1.0).to(dtype)  # a real share of every row's softmax
        inputs.append(sinks)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = tree_attention(*leaves[:3], TreeMask(kv_end), sinks=leaves[3] if sinks is not None else None,
                         backend=backend, **options)
    out.backward(g_out)
    if device != "cpu":
        torch.cuda.synchronize()
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = tree_attention_ref(*ref_in[:3], kv_end, sinks=ref_in[3] if sinks is not None else None, **options)
    ref.backward(g_out.double())
    errs = {"out": unit_err(torch, out, ref) if out.dtype == dtype else math.inf}
    for name, t, r in zip(("dq", "dk", "dv", "dsinks"), leaves, ref_in):
        errs[name] = unit_err(torch, t.grad, r.grad) if t.grad is not None else math.inf
    shape = f"N={n} Hq={hq} Hkv={hkv} D={d} depth<={depth}"
    if options.get("window"):
        shape += f" window={options['window']}"
    return shape, errs, params["dtype"], f"{forest.num_samples} samples, {len(forest.leaves)} leaves", {}


def _logprob_inputs(torch, device, dtype, n, d, v, gen):
    hidden = (_randn(torch, gen, device, n, d) * 2.0).to(dtype)  # logits of std ~2: peaked rows
    weight = (_randn(torch, gen, device, v, d) / d**0.5).to(dtype)
    return hidden, weight


def _logprob_errs(torch, lp, ent, lp_r, ent_r, h, w, hd, wd):
    return {"logprobs": rel_err(torch, lp, lp_r), "entropy": rel_err(torch, ent, ent_r),
            "d_hidden": rel_err(torch, h.grad, hd.grad) if h.grad is not None else math.inf,
            "d_weight": rel_err(torch, w.grad, wd.grad) if w.grad is not None else math.inf}


def _plain_float32(torch, ref, hidden, weight, grads, *args, **kwargs):
    """The reference run in float32 on the same rounded inputs, its loss weighted by the same upstream
    gradients: (logprobs, entropy, hidden, weight) with the leaves' gradients filled."""
    h, w = (t.detach().float().requires_grad_() for t in (hidden, weight))
    lp, ent = ref(h, w, *args, **kwargs)
    g_lp, g_ent = grads
    ((lp * g_lp).sum() + ((ent * g_ent).sum() if g_ent is not None else 0.0)).backward()
    return lp, ent, h, w


def case_tree_logprobs(torch, device, sizes, params, seed):
    from clawfast.kernels import tree_logprobs, tree_logprobs_ref

    dtype = getattr(torch, params["dtype"])
    n, d, v = sizes["rows"], sizes["hidden"], sizes["vocab"]
    forest = Forest(n, samples=8 if n >= 256 else 3, rng=_rng(seed))
    _, rows, ids, *_ = forest.targets(_rng(seed + 1), v)
    rows = torch.tensor(rows, dtype=torch.int32, device=device)
    ids = torch.tensor(ids, dtype=torch.int32, device=device)
    gen = _generator(torch, device, seed)
    hidden, weight = _logprob_inputs(torch, device, dtype, n, d, v, gen)
    g_lp = _randn(torch, gen, device, rows.shape[0]).float()
    g_ent = _randn(torch, gen, device, n).float()
    h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    lp, ent = tree_logprobs(h, w, rows, ids, backend="triton")
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if params["entropy"] else 0.0)
    loss.backward()
    hd, wd = (t.detach().double().requires_grad_() for t in (hidden, weight))
    lp_r, ent_r = tree_logprobs_ref(hd, wd, rows, ids)
    loss_r = (lp_r * g_lp.double()).sum() + ((ent_r * g_ent.double()).sum() if params["entropy"] else 0.0)
    loss_r.backward()
    errs = _logprob_errs(torch, lp, ent, lp_r, ent_r, h, w, hd, wd)
    lp_f, ent_f, h_f, w_f = _plain_float32(torch, tree_logprobs_ref, hidden, weight,
                                           (g_lp, g_ent if params["entropy"] else None), rows, ids)
    plain = _logprob_errs(torch, lp_f, ent_f, lp_r, ent_r, h_f, w_f, hd, wd)
    return (f"N={n} d={d} V={v} M={rows.shape[0]}", errs, params["dtype"],
            f"float32 outputs: {lp.dtype == torch.float32 and ent.dtype == torch.float32}", plain)


def case_linear_logprobs(torch, device, sizes, params, seed):
    from clawfast.kernels import linear_logprobs, linear_logprobs_ref

    dtype = getattr(torch, params["dtype"])
    b, t_len, prompt, d, v = sizes["batch"], sizes["seq"], sizes["prompt"], sizes["hidden"], sizes["vocab"]
    gen = _generator(torch, device, seed)
    hidden = (_randn(torch, gen, device, b, t_len, d) * 2.0).to(dtype)
    weight = (_randn(torch, gen, device, v, d) / d**0.5).to(dtype)
    labels = torch.randint(0, v, (b, t_len), generator=gen, device=device)
    labels[:, :prompt] = -100  # prompt positions: no loss
    labels[-1, -1] = -100
    g_lp = _randn(torch, gen, device, b, t_len).float()
    g_ent = _randn(torch, gen, device, b, t_len).float()
    temperature = params["temperature"]
    h, w = (x.detach().clone().requires_grad_() for x in (hidden, weight))
    lp, ent = linear_logprobs(h, w, labels, temperature=temperature, backend="triton")
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    hd, wd = (x.detach().double().requires_grad_() for x in (hidden, weight))
    lp_r, ent_r = linear_logprobs_ref(hd, wd, labels, temperature=temperature)
    ((lp_r * g_lp.double()).sum() + (ent_r * g_ent.double()).sum()).backward()
    errs = _logprob_errs(torch, lp, ent, lp_r, ent_r, h, w, hd, wd)
    lp_f, ent_f, h_f, w_f = _plain_float32(torch, linear_logprobs_ref, hidden, weight, (g_lp, g_ent), labels,
                                           temperature=temperature)
    plain = _logprob_errs(torch, lp_f, ent_f, lp_r, ent_r, h_f, w_f, hd, wd)
    ignored_zero = bool((lp[labels == -100] == 0).all())
    if not ignored_zero:
        errs["ignored positions are 0"] = math.inf
    return f"B={b} T={t_len} d={d} V={v}", errs, params["dtype"], f"T={temperature}", plain


def _target_batch(torch, device, sizes, seed):
    """The targets of an agent forest with trainer-like log-probs: proximal (old), behaviour (infer,
    the sampler's), current; model-output targets have mask 1, prompt and tool-result targets 0."""
    from clawfast.kernels import TreePaths

    forest = Forest(sizes["rows"], sizes["samples"], _rng(seed))
    ids, rows, tids, roll, model, leaf_rows, leaf_roll, sequences = forest.targets(_rng(seed + 1), 50000)

    def t(x, dt=torch.int64):
        return torch.tensor(x, dtype=dt, device=device)

    paths = TreePaths.from_tree(t(forest.parent), t(ids), t(forest.kv_end), t(rows), t(tids), t(roll),
                                t(leaf_rows), t(leaf_roll))
    m = len(rows)
    gen = torch.Generator().manual_seed(seed)  # host: the references take host tensors
    old = -torch.rand(m, generator=gen, dtype=torch.float64) * 3
    # the current policy moved from the proximal one (so the clip acts), a few targets far (so the dual clip acts)
    lp = old + 0.3 * torch.randn(m, generator=gen, dtype=torch.float64)
    lp += 1.5 * (torch.rand(m, generator=gen) < 0.03)
    batch = dict(old=old, infer=old + 0.05 * torch.randn(m, generator=gen, dtype=torch.float64), lp=lp,
                 adv=torch.randn(m, generator=gen, dtype=torch.float64),
                 ref=old + 0.1 * torch.randn(m, generator=gen, dtype=torch.float64),
                 entropy=torch.rand(m, generator=gen, dtype=torch.float64) * 4,
                 mask=torch.tensor(model, dtype=torch.float64),
                 weight=torch.rand(m, generator=gen, dtype=torch.float64) + 0.5,
                 seq_ids=torch.tensor(roll, dtype=torch.int64))
    # float32 as the trainer has them; the references get the same rounded values in float64
    batch = {k: (x.float() if x.is_floating_point() else x) for k, x in batch.items()}
    return forest, batch, paths, sequences


def case_importance(torch, device, sizes, params, seed):
    from clawfast.kernels import ISConfig, importance_weights, importance_weights_ref

    forest, batch, paths, sequences = _target_batch(torch, device, sizes, seed)
    level, mode = params["level"], params["mode"]
    cfg = ISConfig(level=level, mode=mode, cap=1.5, lo=0.8, hi=1.25)
    # sequence ratios are products over a path: a smaller per-token spread keeps them near 1
    spread = 0.4 if level == "token" else 0.05
    noise = torch.randn(batch["old"].shape[0], generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    lp = (batch["infer"].double() + spread * noise).float()
    res = importance_weights(lp.to(device), batch["infer"].to(device), batch["mask"].to(device), config=cfg,
                             paths=paths if level == "sequence" else None, backend="triton")
    w_ref, met_ref = importance_weights_ref(lp.double(), batch["infer"].double(), batch["mask"].double(),
                                            config=cfg, sequences=sequences if level == "sequence" else None)
    errs = {"weights": rel_err(torch, res.weights.cpu(), w_ref), "metrics": metrics_err(res.metrics, met_ref)}
    note = (f"{len(sequences)} paths, clipped/masked fraction above {met_ref['is_frac_above']:.3f} "
            f"below {met_ref['is_frac_below']:.3f}")
    return f"M={lp.shape[0]} targets, N={forest.n} rows", errs, "float32", note, {}


def case_policy_loss(torch, device, sizes, params, seed):
    from clawfast.kernels import ISConfig, policy_loss, policy_loss_ref

    forest, batch, paths, sequences = _target_batch(torch, device, sizes, seed)
    m = batch["lp"].shape[0]
    if params["default"]:  # the trainer's defaults: step.py, one update at token level
        kw = dict(is_config=ISConfig(), clip_low=0.2, clip_high=0.28, aggregation="token-mean", entropy_coef=0.0)
        with_paths, ref, seq = False, None, None
    else:
        kw = dict(is_config=ISConfig(level="sequence", mode="mask", lo=0.5, hi=2.0), clip_low=0.2, clip_high=0.28,
                  dual_clip=3.0, aggregation="seq-mean-token-mean", entropy_coef=0.01, kl_coef=0.05)
        with_paths, ref, seq = True, batch["ref"], batch["seq_ids"]
        # sequence-level ratios stay near 1 when each token's behaviour / proximal gap is small
        batch = dict(batch, infer=batch["old"] + 0.02 * (batch["infer"] - batch["old"]) / 0.05)
    tensors = dict(weight=batch["weight"], mask=batch["mask"], infer_logprobs=batch["infer"],
                   entropy=batch["entropy"], ref_logprobs=ref, seq_ids=seq)
    lp = batch["lp"].to(device).clone().requires_grad_()
    dev = {k: (x.to(device) if x is not None else None) for k, x in tensors.items()}
    loss, met = policy_loss(lp, batch["old"].to(device), batch["adv"].to(device), **dev,
                            paths=paths if with_paths else None, backend="triton", **kw)
    loss.backward()
    lp_r = batch["lp"].detach().double().requires_grad_()
    host = {k: (x.double() if x is not None and x.is_floating_point() else x) for k, x in tensors.items()}
    loss_r, met_r = policy_loss_ref(lp_r, batch["old"].double(), batch["adv"].double(), **host,
                                    sequences=sequences if with_paths else None, **kw)
    loss_r.backward()
    # The loss averages terms of either sign (advantages are centred), so it can cancel to near zero
    # (seen: 3.8e-4 from terms of size 0.69): its error is measured against the terms' size, the
    # mean |advantage| over the kept targets, as float32 rounds them.
    mask = batch["mask"].double()
    terms = float((batch["adv"].double().abs() * mask).sum() / mask.sum().clamp(min=1))
    errs = {"loss": rel_err(torch, loss.cpu(), loss_r, scale=terms), "d_logprobs": rel_err(torch, lp.grad.cpu(), lp_r.grad),
            "metrics": metrics_err(met, met_r)}
    note = f"clip_frac {met_r['clip_frac']:.3f}, dual_clip_frac {met_r['dual_clip_frac']:.3f}"
    return f"M={m} targets, N={forest.n} rows", errs, "float32", note, {}


def case_gae(torch, device, sizes, params, seed):
    from clawfast.kernels import tree_gae, tree_gae_ref

    forest = Forest(sizes["rows"], sizes["samples"], _rng(seed))
    n = forest.n
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.zeros(n, dtype=torch.float64)
    rewards[torch.tensor(forest.leaves)] = torch.rand(len(forest.leaves), generator=gen, dtype=torch.float64)
    dense = torch.rand(n, generator=gen) < 0.05  # some per-token rewards too (format, tool errors)
    rewards[dense] += 0.1 * torch.randn(int(dense.sum()), generator=gen, dtype=torch.float64)
    values = torch.randn(n, generator=gen, dtype=torch.float64) * 0.5
    mask = torch.tensor(forest.model, dtype=torch.float64)
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    parent = torch.tensor(forest.parent, dtype=torch.int64)
    kw = dict(gamma=params["gamma"], lam=params["lam"], mode=params["mode"])
    adv, ret = tree_gae(rewards.to(device), values.to(device), parent.to(device), mask=mask.to(device),
                        backend="triton", **kw)
    adv_r, ret_r = tree_gae_ref(rewards.double(), values.double(), parent, mask=mask.double(), **kw)
    errs = {"advantages": rel_err(torch, adv.cpu(), adv_r), "returns": rel_err(torch, ret.cpu(), ret_r)}
    return f"N={n} depth<={forest.depth()} leaves={len(forest.leaves)}", errs, "float32", "", {}


def case_grpo(torch, device, sizes, params, seed):
    from clawfast.kernels import grpo_advantages, grpo_advantages_ref

    groups, samples = sizes["groups"], sizes["samples"]
    gen = torch.Generator().manual_seed(seed)
    r = groups * samples
    # float64, as the trainer passes them (clawfast/train/algorithms.py)
    rewards = (torch.rand(r, generator=gen) < 0.4).double() + 0.1 * torch.rand(r, generator=gen, dtype=torch.float64)
    task = torch.arange(r) // samples
    harness = torch.randint(0, 2, (r,), generator=gen)
    keys = torch.stack([task, harness], 1)
    keys[0] = torch.tensor([groups, 0])  # a group of one: advantage 0
    adv = grpo_advantages(rewards.to(device), keys.to(device))
    adv_r = grpo_advantages_ref(rewards.double(), keys)
    return f"R={r} rewards", {"advantages": rel_err(torch, adv.cpu(), adv_r)}, "float64", "", {}


RUNNERS = {"attention": case_attention, "tree_logprobs": case_tree_logprobs, "linear_logprobs": case_linear_logprobs,
           "importance": case_importance, "policy_loss": case_policy_loss, "gae": case_gae, "grpo": case_grpo}
