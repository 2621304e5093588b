"""Plain references of every op in clawfast.kernels, imported by the tests and the benchmarks.

Each is written the obvious way (dense logits, explicit root-to-leaf paths, Python loops over time
steps and groups), differentiable by autograd where gradients flow, and meant for small inputs. They
define what the fast paths must compute.
"""

from __future__ import annotations

import math

import torch

from ._common import dropout_keep, dropout_threshold
from .importance import METRIC_NAMES as IS_METRIC_NAMES
from .importance import ISConfig
from .policy_loss import LOSS_METRIC_NAMES


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------- log-probs


def tree_logprobs_ref(hidden, weight, target_rows, target_ids, *, temperature=1.0):
    """Dense: ``log_softmax(hidden @ weight.T / T)`` gathered at (row, id); entropy of every row."""
    dt = _acc(hidden.dtype)
    logp = torch.log_softmax((hidden.to(dt) @ weight.to(dt).t()) / temperature, dim=-1)
    lp = logp[target_rows.long(), target_ids.long()]
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def linear_logprobs_ref(hidden, weight, labels, *, temperature=1.0, ignore_index=-100):
    """The naive flat form: ``log_softmax(hidden @ weight.T).gather(labels)`` (0 where ignored)."""
    dt = _acc(hidden.dtype)
    logp = torch.log_softmax((hidden.to(dt) @ weight.to(dt).t()) / temperature, dim=-1)
    valid = labels != ignore_index
    lp = logp.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), ent


# ---------------------------------------------------------------------------------- attention


def tree_mask_ref(kv_end, window=None):
    """bool [N, N]: True where query row i may attend to key row j, i.e. ``j <= i <= kv_end[j]``;
    with a sliding ``window``, also ``depth_i - depth_j < window`` (depth: a row's number of
    ancestors, its position in its path)."""
    n = kv_end.shape[0]
    idx = torch.arange(n, device=kv_end.device)
    if n and (bool((kv_end < idx).any()) or bool((kv_end >= n).any())):
        raise ValueError("kv_end[j] must lie in [j, N) for every row j")
    allowed = (idx[None, :] <= idx[:, None]) & (idx[:, None] <= kv_end.long()[None, :])
    if window is not None:
        depth = allowed.sum(1) - 1  # a row sees its ancestors and itself
        allowed &= depth[:, None] - depth[None, :] < window
    return allowed


def tree_attention_ref(q, k, v, kv_end, *, scale=None, window=None, softcap=None, sinks=None, dropout_p=0.0,
                       seed=0):
    """Dense: ``softmax(q k^T * scale)`` under `tree_mask_ref`, per head (GQA: query head h reads
    key head ``h // (Hq // Hkv)``); q [N, Hq, D], k and v [N, Hkv, D] -> [N, Hq, D].

    ``window``: the sliding window of `tree_mask_ref`; ``softcap``: scores ``softcap * tanh(s /
    softcap)``; ``sinks`` [Hq]: one more logit per head in the softmax, dropped from the weights
    (gpt-oss's eager attention); ``dropout_p``: the weights dropped where `dropout_keep` (of
    ``seed``, head, query row, key row) says so and the rest scaled by 1 / (1 - dropout_p)."""
    dt = _acc(q.dtype)
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    allowed = tree_mask_ref(kv_end, window)
    kk = k.to(dt).repeat_interleave(group, dim=1)
    vv = v.to(dt).repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q.to(dt), kk) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(dt)[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout_p:
        rows = torch.arange(q.shape[0], device=q.device)
        keep = dropout_keep(seed, torch.arange(q.shape[1], device=q.device), rows, rows, dropout_threshold(dropout_p))
        probs = probs * keep / (1.0 - dropout_p)
    return torch.einsum("hij,jhd->ihd", probs, vv).to(q.dtype)


# ---------------------------------------------------------------------------------------- GAE


def gae_loop(rewards, values, mask, gamma, lam):
    """verl's ``compute_gae_advantage_return`` loop over time steps on [B, T] (no whitening).

    The straightforward baseline of common RL stacks: context tokens (mask 0) carry the next value
    and the running advantage across.
    """
    nextvalues = torch.zeros_like(rewards[:, 0])
    lastgaelam = torch.zeros_like(rewards[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def _children(parent_row):
    kids = [[] for _ in range(len(parent_row))]
    for i, p in enumerate(parent_row.tolist()):
        if p >= 0:
            kids[p].append(i)
    return kids


def tree_paths_ref(parent_row):
    """Every root-to-leaf path of a forest as a list of rows (leaves in DFS order)."""
    parent = parent_row.tolist()
    kids = _children(parent_row)
    paths = []
    for leaf in range(len(parent)):
        if kids[leaf]:
            continue
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parent[i]
        paths.append(path[::-1])
    return paths


def tree_gae_ref(rewards, values, parent_row, *, mask=None, gamma=1.0, lam=1.0, mode="path"):
    """"path": verl's loop on every expanded root-to-leaf path, each row averaged over the paths
    through it. "tree": a reverse loop over rows where a branch point takes the mean of its
    children's next value and advantage."""
    n = rewards.shape[0]
    dt = _acc(rewards.dtype if rewards.dtype == torch.float64 else values.dtype)
    r, v = rewards.to(dt), values.to(dt)
    m = torch.ones(n, dtype=dt) if mask is None else mask.to(dt)
    if mode == "path":
        total = torch.zeros(n, dtype=dt)
        count = torch.zeros(n, dtype=dt)
        for path in tree_paths_ref(parent_row):
            idx = torch.tensor(path, dtype=torch.long)
            adv, _ = gae_loop(r[idx][None], v[idx][None], m[idx][None], gamma, lam)
            total[idx] += adv[0]
            count[idx] += 1
        adv = total / count
        return adv, adv + v
    if mode != "tree":
        raise ValueError(mode)
    kids = _children(parent_row)
    nv_out = [0.0] * n
    ga_out = [0.0] * n
    for i in reversed(range(n)):
        ks = kids[i]
        nv = sum(nv_out[c] for c in ks) / len(ks) if ks else 0.0
        ga = sum(ga_out[c] for c in ks) / len(ks) if ks else 0.0
        delta = float(r[i]) + gamma * nv - float(v[i])
        if float(m[i]) > 0:
            ga_out[i], nv_out[i] = delta + gamma * lam * ga, float(v[i])
        else:
            ga_out[i], nv_out[i] = ga, nv
    adv = torch.tensor(ga_out, dtype=dt)
    return adv, adv + v


# ------------------------------------------------------------------------------ sequences & IS


def tree_sequences_ref(parent_row, input_ids, target_rows, target_ids, target_rollout=None,
                       leaf_rows=None, leaf_rollout=None):
    """For every leaf, the list of target indices on its root-to-leaf path (explicit walk)."""
    parent = parent_row.tolist()
    ids = input_ids.tolist()
    m = target_rows.shape[0]
    t_group = [0] * m if target_rollout is None else target_rollout.tolist()
    child = []
    for r, t in zip(target_rows.tolist(), target_ids.tolist()):
        child.append(next(c for c in range(len(parent)) if parent[c] == r and ids[c] == t))
    if leaf_rows is None:
        has_kid = {p for p in parent if p >= 0}
        leaf_rows = torch.tensor([i for i in range(len(parent)) if i not in has_kid])
    l_group = [0] * len(leaf_rows) if leaf_rollout is None else leaf_rollout.tolist()
    seqs = []
    for leaf, g in zip(leaf_rows.tolist(), l_group):
        on_path, i = set(), leaf
        while i >= 0:
            on_path.add(i)
            i = parent[i]
        seqs.append([k for k in range(m) if child[k] in on_path and t_group[k] == g])
    return seqs


def _weights_ref(lr, cfg: ISConfig):
    rho = torch.exp(lr.clamp(-cfg.log_clamp, cfg.log_clamp))
    if cfg.mode == "truncate":
        return rho, torch.clamp(rho, max=cfg.cap)
    return rho, torch.where((rho >= cfg.lo) & (rho <= cfg.hi), rho, torch.zeros_like(rho))


def _ratio_metrics_ref(rho, a, w, cfg):
    """Ratio statistics over items with weights a (a > 0 only), by the textbook formulas."""
    keep = a > 0
    rho, a, w = rho[keep], a[keep], w[keep]
    if rho.numel() == 0:
        return [0.0] * 9 + [0]
    lo, hi = cfg.thresholds
    mean = float((a * rho).sum() / a.sum())
    var = float((a * (rho - mean) ** 2).sum() / a.sum())
    return [mean, math.sqrt(var), float(rho.min()), float(rho.max()),
            float(a[rho > hi].sum() / a.sum()), float(a[rho < lo].sum() / a.sum()),
            float((a * rho).sum() ** 2 / (a.sum() * (a * rho * rho).sum())),
            float((a * rho * rho).sum() / a.sum()) - 1.0, float((a * w).sum() / a.sum()),
            int(keep.sum())]


def importance_weights_ref(logprobs, infer_logprobs, mask=None, *, config=ISConfig(),
                           sequences=None):
    """(weights[M], metrics dict); ``sequences``: list of target-index lists (sequence level)."""
    m = logprobs.shape[0]
    a = torch.ones(m, dtype=torch.float64) if mask is None else mask.double()
    valid = a > 0
    lr = torch.zeros(m, dtype=torch.float64)
    lr[valid] = logprobs.detach().double()[valid] - infer_logprobs.double()[valid]
    lrc = lr.clamp(-config.log_clamp, config.log_clamp)
    tok_rho = torch.exp(lrc)
    k1 = float((a[valid] * -lrc[valid]).sum() / a[valid].sum()) if valid.any() else 0.0
    k3 = (float((a[valid] * (tok_rho[valid] - 1 - lrc[valid])).sum() / a[valid].sum())
          if valid.any() else 0.0)
    if config.level == "token":
        rho, w = _weights_ref(lr, config)
        w = torch.where(valid, w, torch.zeros_like(w))
        stats = _ratio_metrics_ref(rho, a, w, config)
    else:
        seq_lr = torch.tensor([float(lr[s].sum()) for s in sequences], dtype=torch.float64)
        seq_a = torch.tensor([1.0 if any(valid[k] for k in s) else 0.0 for s in sequences],
                             dtype=torch.float64)
        rho, w_seq = _weights_ref(seq_lr, config)
        w_seq = torch.where(seq_a > 0, w_seq, torch.zeros_like(w_seq))
        stats = _ratio_metrics_ref(rho, seq_a, w_seq, config)
        w = torch.zeros(m, dtype=torch.float64)
        for k in range(m):
            if valid[k]:
                through = [w_seq[j] for j, s in enumerate(sequences) if k in s]
                w[k] = sum(through) / len(through)
    values = stats[:9] + [k1, k3, stats[9]]
    return w, dict(zip(IS_METRIC_NAMES, [float(x) for x in values]))


# -------------------------------------------------------------------------------- policy loss


def policy_loss_ref(logprobs, old_logprobs, advantages, *, mask=None, weight=None,
                    infer_logprobs=None, is_config=ISConfig(), sequences=None, is_weights=None, clip_low=0.2,
                    clip_high=None, dual_clip=None, aggregation="token-mean", seq_ids=None,
                    entropy=None, entropy_coef=0.0, ref_logprobs=None, kl_coef=0.0):
    """Per-target loss terms and the aggregation written out with Python loops over sequences.

    IS weight: from ``old_logprobs`` vs ``infer_logprobs`` (`importance_weights_ref`), or
    ``is_weights`` as given, or 1."""
    clip_high = clip_low if clip_high is None else clip_high
    m = logprobs.shape[0]
    dt = _acc(logprobs.dtype)
    a = torch.ones(m, dtype=dt) if mask is None else mask.to(dt)
    if weight is not None:
        a = a * weight.to(dt)
    keep = torch.nonzero(a > 0).view(-1).tolist()
    lp = logprobs.to(dt)
    old = lp.detach() if old_logprobs is None else old_logprobs.to(dt)
    if infer_logprobs is not None:
        is_w, is_metrics = importance_weights_ref(old, infer_logprobs, a, config=is_config,
                                                  sequences=sequences)
        is_w = is_w.to(dt)
    elif is_weights is not None:
        is_w, is_metrics = is_weights.detach().to(dt), {}
    else:
        is_w, is_metrics = torch.ones(m, dtype=dt), {}

    def term(k):
        log_r = (lp[k] - old[k]).clamp(-20, 20)
        r = torch.exp(log_r)
        adv = advantages[k].to(dt)
        pg1, pg2 = -adv * r, -adv * r.clamp(1 - clip_low, 1 + clip_high)
        pg = torch.maximum(pg1, pg2)
        dual = False
        if dual_clip is not None and adv < 0 and -adv * dual_clip < pg:
            pg, dual = -adv * dual_clip, True
        return is_w[k] * pg, bool(pg2 > pg1), dual, r, log_r

    def agg(values):  # values: dict k -> 0-d tensor
        if aggregation == "token-mean":
            if not keep:
                return torch.zeros((), dtype=dt) + 0 * lp.sum()
            return sum(a[k] * values[k] for k in keep) / sum(a[k] for k in keep)
        groups = {}
        for k in keep:
            groups.setdefault(int(seq_ids[k]), []).append(k)
        if not groups:
            return torch.zeros((), dtype=dt) + 0 * lp.sum()
        per_seq = []
        for ks in groups.values():
            s = sum(a[k] * values[k] for k in ks)
            if aggregation == "seq-mean-token-mean":
                s = s / sum(a[k] for k in ks)
            per_seq.append(s)
        return sum(per_seq) / len(per_seq)

    parts = {k: term(k) for k in keep}
    stats = {k: (float(p[3].detach()), float(p[4].detach())) for k, p in parts.items()}
    pg_loss = agg({k: parts[k][0] for k in keep})
    loss = pg_loss
    ent_mean = kl_mean = torch.zeros((), dtype=dt)
    if entropy is not None:
        ent_mean = agg({k: entropy[k].to(dt) for k in keep})
        loss = loss - entropy_coef * ent_mean
    if ref_logprobs is not None:
        def k3(k):
            d = (ref_logprobs[k].to(dt) - lp[k]).clamp(-20, 20)
            return torch.exp(d) - d - 1
        kl_mean = agg({k: k3(k) for k in keep})
        loss = loss + kl_coef * kl_mean
    den = sum(float(a[k]) for k in keep) or 1.0
    metrics = {
        "pg_loss": float(pg_loss.detach()), "entropy": float(ent_mean.detach()),
        "kl_ref": float(kl_mean.detach()),
        "clip_frac": sum(float(a[k]) * parts[k][1] for k in keep) / den,
        "dual_clip_frac": sum(float(a[k]) * parts[k][2] for k in keep) / den,
        "ratio_mean": sum(float(a[k]) * stats[k][0] for k in keep) / den,
        "approx_kl_old": sum(float(a[k]) * (math.exp(stats[k][1]) - 1 - stats[k][1])
                             for k in keep) / den,
    }
    assert tuple(metrics) == LOSS_METRIC_NAMES
    metrics.update(is_metrics)
    return loss, metrics


def grpo_advantages_ref(rewards, group_keys, *, normalize_std=True, eps=1e-6):
    """Python grouping by key tuple; unbiased std; a group of one gets 0."""
    keys = group_keys if group_keys.dim() == 2 else group_keys[:, None]
    groups = {}
    for i, key in enumerate(map(tuple, keys.tolist())):
        groups.setdefault(key, []).append(i)
    r = rewards.to(_acc(rewards.dtype))
    out = torch.zeros_like(r)
    for idx in groups.values():
        if len(idx) == 1:
            continue
        vals = r[idx]
        centred = vals - vals.mean()
        out[idx] = centred / (vals.std() + eps) if normalize_std else centred
    return out
