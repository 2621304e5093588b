"""The synthetic forests of the GPU check, built on the host with rows in DFS order (docs/TREE.md): packed
agent rollouts, a shared prompt per group and samples that fork where a harness retried or edited.

- `Forest` (bench/gpu_correctness_cases.py): a chosen number of rows with a fork probability, every
  non-root row a target (prompt and tool-result rows too, owned by every sample of their group), so
  the correctness cases exercise rows with many targets and masked targets at moderate, exact sizes.
  Not the real pipeline (`clawfast.synthetic.task_group` -> `clawfast.tree.build_tree` ->
  `clawfast.pack.pack`): its batch sizes follow the rollouts' contents, not a requested N (a smoke
  run's 40 rows are out of its reach), it forks rarely, and its targets are model-output tokens only,
  loss mask all 1, almost never several on one row (8 rollouts of 12 calls with 512-token prompts:
  ~3.8K rows, 9 branch rows, ~800 targets, one row with more than one).
- `agent_parent` (bench/gpu_kernels_attention.py, bench/gpu_kernels_small.py): the timing cases'
  forest of 4 samples under a shared prompt, turns of up to 256 rows with retries.
"""

from __future__ import annotations


def subtree_ends(parent: list[int]) -> list[int]:
    """kv_end[j]: the last row of j's subtree (rows in DFS order)."""
    end = list(range(len(parent)))
    for i in reversed(range(len(parent))):
        if parent[i] >= 0:
            end[parent[i]] = max(end[parent[i]], end[i])
    return end


class Forest:
    """An agent-shaped packed forest in DFS order: ``groups`` trees, each a shared prompt chain then
    ``samples`` samples under its last row; a sample is segments (model output, tool result,
    alternately) that continue the last one or, with probability ``p_fork``, fork from an earlier
    segment end of the same sample (a retried call, an edited history). Host lists: parent[N],
    sample[N] (-1 on a prompt row), model[N] (1 on model-output rows), kv_end[N]."""

    def __init__(self, n: int, samples: int, rng, groups: int = 2, prompt_frac: float = 0.25,
                 max_segment: int | None = None, p_fork: float = 0.25):
        self.n = n
        max_segment = max_segment or max(2, n // (samples * groups * 3))
        parent, sample, model = [], [], []
        per_group = [n // groups + (1 if g < n % groups else 0) for g in range(groups)]
        sample_id = 0
        for g_rows in per_group:
            prompt = max(1, int(g_rows * prompt_frac))
            start = len(parent)
            for i in range(prompt):
                parent.append(-1 if i == 0 else start + i - 1)
                sample.append(-1)
                model.append(0)
            rest = g_rows - prompt
            k = max(1, min(samples, rest))
            sizes = [rest // k + (1 if s < rest % k else 0) for s in range(k)]
            for size in sizes:
                stack = [start + prompt - 1]
                kind = 1
                left = size
                while left > 0:
                    length = min(left, int(rng.integers(1, max_segment + 1)))
                    if len(stack) > 1 and rng.random() < p_fork:
                        del stack[int(rng.integers(1, len(stack))):]  # back to an earlier segment end
                    for i in range(length):
                        parent.append(stack[-1] if i == 0 else len(parent) - 1)
                        sample.append(sample_id)
                        model.append(kind)
                    stack.append(len(parent) - 1)
                    kind = 1 - kind
                    left -= length
                sample_id += 1
        self.parent, self.sample, self.model = parent, sample, model
        self.num_samples = sample_id
        self.kv_end = subtree_ends(parent)
        kids = [0] * n
        for p in parent:
            if p >= 0:
                kids[p] += 1
        self.leaves = [i for i in range(n) if kids[i] == 0]
        self.group_of_sample = {}
        for i in range(n):
            if sample[i] >= 0:
                root = i
                while parent[root] >= 0:
                    root = parent[root]
                self.group_of_sample.setdefault(sample[i], root)

    def depth(self) -> int:
        depth = [0] * self.n
        for i, p in enumerate(self.parent):
            depth[i] = depth[p] + 1 if p >= 0 else 1
        return max(depth)

    def targets(self, rng, vocab: int):
        """Tree targets as a packed batch has them: every non-root row c is predicted from its parent,
        once per rollout with a kept leaf below c (a prompt row: every sample of its group). Returns
        (input_ids[N], target_rows, target_ids, target_rollout, target_model, leaf_rows, leaf_rollout,
        sequences) with distinct ids among siblings and ``sequences[l]`` the target indices on leaf l's
        path (the explicit walk the sequence-level references take)."""
        n, parent = self.n, self.parent
        ids = [0] * n
        taken: dict[int, set] = {}
        for c in range(n):
            used = taken.setdefault(parent[c], set())
            while True:
                t = int(rng.integers(0, vocab))
                if t not in used:
                    used.add(t)
                    ids[c] = t
                    break
        samples_of_root: dict[int, list[int]] = {}
        for s, root in self.group_of_sample.items():
            samples_of_root.setdefault(root, []).append(s)
        root_of = [0] * n
        for i in range(n):
            root_of[i] = i if parent[i] < 0 else root_of[parent[i]]
        rows, tids, roll, model, child = [], [], [], [], []
        for c in range(n):
            if parent[c] < 0:
                continue
            owners = [self.sample[c]] if self.sample[c] >= 0 else sorted(samples_of_root.get(root_of[c], []))
            for r in owners:
                rows.append(parent[c])
                tids.append(ids[c])
                roll.append(r)
                model.append(self.model[c])
                child.append(c)
        leaf_rows = [leaf for leaf in self.leaves if self.sample[leaf] >= 0]
        leaf_roll = [self.sample[leaf] for leaf in leaf_rows]
        by_rollout: dict[int, list[int]] = {}
        for k, r in enumerate(roll):
            by_rollout.setdefault(r, []).append(k)
        sequences = []
        for leaf, r in zip(leaf_rows, leaf_roll):
            on_path, i = set(), leaf
            while i >= 0:
                on_path.add(i)
                i = parent[i]
            sequences.append(IndexList(k for k in by_rollout.get(r, []) if child[k] in on_path))
        return ids, rows, tids, roll, model, leaf_rows, leaf_roll, sequences


class IndexList(list):
    """A list of target indices (what the sequence-level references take) that answers ``in`` from a
    set: the references ask it once per (target, sequence), which a plain list makes quadratic."""

    def __init__(self, items=()):
        super().__init__(items)
        self._set = frozenset(self)

    def __contains__(self, item) -> bool:
        return item in self._set


def agent_parent(torch, n, gen):
    """A forest like a packed GRPO group: 4 samples under a shared prompt, turns with retries."""
    parent = list(range(-1, n // 8 - 1))
    per = (n - len(parent)) // 4
    for _ in range(4):
        attach, left = n // 8 - 1, per
        while left > 0:
            length = min(left, 256)
            start = len(parent)
            parent.extend([attach] + list(range(start, start + length - 1)))
            left -= length
            if float(torch.rand(1, generator=gen)) < 0.2:
                attach = start  # the next turn branches from inside this one (an edit/retry)
            else:
                attach = start + length - 1
    return torch.tensor(parent, dtype=torch.int32)
