"""A rollout's threads, rebuilt from the token structure of its calls.

A harness sends every call as a whole conversation, so which call continues which is in the prompts
themselves; no marker string is needed. `reconstruct(calls)` gives each call the call it `extends`,
its `thread` (``"main"`` or ``"<kind>:<first call index>"``) and its `kind` (`KINDS`), and locates
every place where the main thread does not continue exactly. The rules (docs/HARNESSES.md has them
as a table, with the shapes seen on each harness and the failure modes) rest on two patterns: a call
holds m's *turn* when it holds the end of m's prompt followed by the start of m's answer (the
conversation goes on from m), and *quotes* m's answer when it holds the answer's text elsewhere (a
tool result, a summary): its middle, or a piece of its head followed by one of its tail (the answer
cut in the middle, as tool-output truncation does).

1. **Probe**: at most one token sampled, stopped on length: ``quota``.
2. **Links**, each call against the earlier ones: *extends* p (replays p's whole prompt, up to the
   ending most distinct prompts share, and p's turn); a *fork* (replays p's prompt but not its turn:
   continues nothing, or, if nothing takes up p's answer, is a retry of p); a *retry* (p's very
   prompt: continues what p continues; if both answers were used, taken up or quoted back, the
   harness started two threads alike, and it is linked as p is, in a thread of its own); *edited* (holds the turn of a
   later call m past the prefix it shares, agreeing with m as far, and keeps the first prompt of m's
   thread: the harness rewrote the history and went on from m; a call that keeps less, or that the
   proxy hinted as a side call, starts a thread of its own), unless m's history later goes on
   without it.
3. **Compaction**: a call that continues no call whole quotes the answer of a call k that nothing
   continued, and shares at least half of the first prompt of the thread k was given (for a k that
   continues nothing, the thread whose turns or answers it re-read, following a quoted partial
   summary back to what that read): k is a ``compaction``; the call restarts that thread. The
   partial summaries k merges (calls that continue nothing, whose answers only k took up, that read
   that thread: a compaction in stages) are ``compaction`` too.
4. **Subagent**: a chain whose last answer is quoted, past the shared prefix, by a later call of
   another chain that continues it (or by a compaction call).
5. **Main**: the longest other chain (ties: the one shown the longest prompt, then the one that
   sampled more tokens, then the one ending last), preferring chains that did not start by
   re-reading another chain's turns or answers; in it, an edited one-off its chain went on without,
   and a call that extends the history with a message of its own the chain then replaced (a
   next-speaker check), are ``summary``.
   A one-call side chain is a ``title`` (holds no earlier answer) or a ``summary``; a longer one is
   ``other-side``.
6. **Hints**: the proxy's tags decide only what the structure cannot (a hinted side chain is main
   only if nothing else is; a chain most of whose calls are hinted subagent; a compaction hint on
   the main chain's last call, or on a call whose answer is too plain to quote, held whole by a
   restart; a one-off's hinted kind).
7. **Links** (`Link`): a subagent's last call ``returns`` into the call its answer comes back in; a
   compaction call ``restarts`` the thread, and the main thread's last call before the restart
   ``resumes`` in it; a compaction whose summary another compaction call summarises again (Claude
   Code compacting in pieces after a context refusal, a partial summary merged) ``restarts`` in that
   call. PPO's GAE follows them when the side kind is trained (`algorithm.train_threads`).

Guaranteed: every call gets one `CallThread`; a call's `extends` is an earlier call. Continuity
counts, for each main call that extends a main call, whether its prompt starts with all of that
call's prompt + output; every main call that does not, and every restart after a compaction, is one
`Divergence` with the token where it departs and its cause. Not guaranteed: the right answer where
two rules see the same shape (docs/HARNESSES.md lists them); answers too short to quote (under
`MIN_ANSWER` + 3 tokens) leave the links that rest on them to the hints.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from clawfast.records import TAGS, CallRecord

KINDS = TAGS  # a call's kind is the tag training excludes it by (every kind but main)
CAUSES = ("history edit", "compaction", "template re-render")
MIN_ANSWER = 6  # tokens of an answer's middle to look for in later prompts; fewer would match by chance
ANSWER_END = 2 * MIN_ANSWER  # tokens of each piece kept from an answer's head and tail when its middle is cut
TURN_TOKENS = 6  # tokens on each side of where a replayed answer begins
# An answer quoted by its last part alone (the text after a reasoning block; a summary without the
# analysis written before it): pieces of this many tokens, ending 0, 1, ... TAIL_PIECES - 1 times
# ANSWER_END tokens before the answer's rewrapped end (a closing tag the harness strips), are looked for.
TAIL_TOKENS = 2 * ANSWER_END
TAIL_PIECES = 2
_HINTED_SIDE = {"subagent", "compaction", "title", "quota"}


@dataclass(frozen=True)
class CallThread:
    call_index: int
    thread: str  # "main", or "<kind>:<first call index>" of a side thread
    kind: str  # one of KINDS
    extends: int | None  # the call whose prompt + output this call's prompt continues; None: a root
    reason: str  # which rule decided `kind`


@dataclass(frozen=True)
class Divergence:
    call_index: int  # the main call whose prompt departs
    against: int  # the main call it continues (for a compaction restart: the last one before it)
    token_index: int  # first prompt position that differs from `against`'s prompt + output
    cause: str  # one of CAUSES


LINK_KINDS = ("returns", "restarts", "resumes")


@dataclass(frozen=True)
class Link:
    """Where one thread hands on to another: what `source` produced is read by `target`, which goes on
    from it. kind: "returns" (a subagent's last call; its answer comes back in `target`), "restarts"
    (a compaction call; `target` is the thread restarted from its summary, or the compaction call
    that summarises that summary again), "resumes" (the thread's
    last call before a compaction; `target` restarts it). `thread_kind`: the side kind whose training
    the link belongs to (`subagent` or `compaction`)."""

    kind: str  # one of LINK_KINDS
    source: int  # call_index
    target: int  # call_index

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ValueError(f"unknown link kind {self.kind!r}; expected one of {LINK_KINDS}")

    @property
    def thread_kind(self) -> str:
        return "subagent" if self.kind == "returns" else "compaction"


@dataclass
class RolloutThreads:
    calls: list[CallThread]  # in call-index order
    divergences: list[Divergence]
    main_pairs: int  # main calls that extend a main call
    exact_pairs: int  # of those, the ones whose prompt starts with all of its prompt + output
    drift: int  # tokens of the extended calls' prompt + output that those prompts did not reuse
    links: list[Link] = dataclasses.field(default_factory=list)  # by (target, source)

    @property
    def continuity(self) -> float:
        return self.exact_pairs / self.main_pairs if self.main_pairs else 1.0

    def kind_of(self) -> dict[int, str]:
        return {t.call_index: t.kind for t in self.calls}


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    # In chunks: a thread's prompts share long prefixes and differ late, unrelated ones differ early.
    for lo in range(0, n, 8192):
        hi = min(lo + 8192, n)
        diff = np.flatnonzero(a[lo:hi] != b[lo:hi])
        if diff.size:
            return lo + int(diff[0])
    return n


def shared_with_path(prompt: np.ndarray, p_prompt: np.ndarray, p_output: np.ndarray) -> int:
    """Tokens `prompt` starts with of the path `p_prompt + p_output`, without building that path."""
    s = _lcp(prompt, p_prompt)
    if s < len(p_prompt):
        return s
    return s + _lcp(prompt[s:], p_output)


def _ending_slack(prompts: list[np.ndarray], keys: list[bytes]) -> list[int]:
    """For each prompt, how many of its last tokens are the ending that most prompts share (the
    generation prompt, and what comes before it alike in most prompts, such as the end of a message
    frame; a later prompt may render it otherwise where it replays the turn), at most all
    but its first token. Most: more than half of the distinct prompts, so that a call of another
    shape (another template, a raw completion) does not take the ending from all the others, and the
    retries of one prompt do not make it theirs. `keys`: the prompts as bytes, to tell them apart."""
    distinct = list(dict(zip(keys, prompts)).values())
    ending: list[int] = []  # the shared ending, last token first
    alive = distinct if len(distinct) > 1 else []  # one prompt (and its retries): nothing to compare
    while True:
        k = len(ending)
        alive = [p for p in alive if len(p) > k]
        if not alive:
            break
        values, counts = np.unique([int(p[-1 - k]) for p in alive], return_counts=True)
        if 2 * counts.max() <= len(distinct):
            break
        ending.append(int(values[counts.argmax()]))
        alive = [p for p in alive if p[-1 - k] == ending[-1]]
    out = []
    for p in prompts:
        n = 0
        while n < min(len(ending), len(p) - 1) and p[-1 - n] == ending[n]:
            n += 1
        out.append(n)
    return out


def token_position(haystack: bytes, needle: bytes, start_token: int = 0) -> int:
    """The first token position of `needle` in `haystack` (int32 token ids as bytes) at or after
    `start_token`, or -1."""
    at = haystack.find(needle, 4 * start_token)
    while at != -1 and at % 4:  # only matches aligned on a token boundary count
        at = haystack.find(needle, at + 1)
    return at // 4 if at != -1 else -1


def _find(haystack: bytes, needle: bytes, start_token: int = 0) -> bool:
    return token_position(haystack, needle, start_token) != -1


class _Rollout:
    """The link pass: each call against the earlier ones, in call order."""

    def __init__(self, calls: list[CallRecord]) -> None:
        n = len(calls)
        self.prompts = [np.ascontiguousarray(c.prompt_ids, np.int32) for c in calls]
        self.outputs = [np.ascontiguousarray(c.output_ids, np.int32) for c in calls]
        self.bytes = [p.tobytes() for p in self.prompts]
        self.slack = _ending_slack(self.prompts, self.bytes)
        self.quota = [len(o) <= 1 and c.finish_reason == "length" for c, o in zip(calls, self.outputs)]
        self.side_hint = [any(t in _HINTED_SIDE for t in c.tags) for c in calls]
        self.turns = [self._turn(i) for i in range(n)]
        self.answers = [self._answer(i) for i in range(n)]
        self.ends = [self._ends(i) for i in range(n)]
        self.tails = [self._tails(i) for i in range(n)]
        self.parent: list[int | None] = [None] * n
        self.link = [""] * n  # "extends" | "edited" | "retry" | "" (continues nothing)
        self.shared = [0] * n  # tokens shared with the parent's prompt + output
        self.retry_of: list[int | None] = [None] * n  # the earlier call asked with the same prompt
        self.replayed: list[tuple[int | None, int]] = [(None, 0)] * n  # the extends link before an edit
        self.forked_from: list[int | None] = [None] * n
        by_prompt: dict[bytes, int] = {}
        by_length: list[tuple[int, int]] = []  # (-path length, -index) of earlier linkable calls
        for i in range(n):
            if self.quota[i]:
                continue
            earlier = by_prompt.get(self.bytes[i])
            if earlier is not None:
                self.parent[i], self.link[i], self.shared[i] = self.parent[earlier], "retry", self.shared[earlier]
                self.retry_of[i] = earlier
            else:
                self._link(i, by_length)
                by_prompt[self.bytes[i]] = i
            bisect.insort(by_length, (-(len(self.prompts[i]) + len(self.outputs[i])), -i))
        # A fork of a call whose answer nothing took up replaces it (the harness dropped the answer
        # and asked again, e.g. after a length cut): a retry. A fork of a call the history goes on
        # from asked something else of that history (a title, a compaction request): it continues nothing.
        # Of several such forks, the ones something continues, else the last, are the harness's.
        taken_up = {self.parent[j] for j in range(n) if self.link[j] in ("extends", "edited")}
        # A call asked on the very prompt of an earlier one, where both answers were used (taken up,
        # or quoted back: a subagent done in one call), did not replace it: the harness started two
        # threads alike (parallel subagents given the same task). It is linked as the earlier call
        # is, as a thread of its own.
        # A prompt a later call's prompt holds whole (it extends it): a quote in it is in that one too, so
        # only the others are searched (a thread's calls' prompts hold one another: n searches became
        # one per thread).
        held = [False] * n
        for k in range(n):
            p = self.parent[k]
            if p is not None and self.link[k] == "extends" and self.shared[k] >= len(self.prompts[p]):
                held[p] = True

        @functools.cache
        def used(m: int) -> bool:  # the conversation went on from m's answer, or it came back quoted
            return m in taken_up or any(self.quote_at(j, m) != -1 for j in range(m + 1, n) if not held[j])

        # Against every earlier call on the prompt, not only the first: that one may be a dead attempt
        # that a retry replaced, with a second thread alike started after it.
        asked: dict[bytes, list[int]] = {}
        for i in range(n):
            asked.setdefault(self.bytes[i], []).append(i)
        for i in range(n):
            e = self.retry_of[i]
            if e is not None and used(i) and any(used(k) for k in asked[self.bytes[i]] if k < i):
                # parent and shared are e's already
                self.link[i], self.replayed[i] = self.link[e], self.replayed[e]
                self.forked_from[i], self.retry_of[i] = self.forked_from[e], None
        forks: dict[int, list[int]] = {}
        for i in range(n):
            if self.forked_from[i] is not None and self.forked_from[i] not in taken_up and self.link[i] == "":
                forks.setdefault(self.forked_from[i], []).append(i)
        for p, group in forks.items():
            for i in [i for i in group if i in taken_up] or group[-1:]:
                self.link[i], self.retry_of[i] = "retry", p
        # An edited link to a call whose history later goes on without it is a side call that re-read
        # the history (a summary request, a subagent handed the last turns): it keeps only what it replays.
        last_extension: dict[int, int] = {}
        for j in range(n):
            if self.link[j] == "extends":
                last_extension[self.parent[j]] = j
        for i in range(n):
            if self.retry_of[i] is not None:
                e = self.retry_of[i]
                self.parent[i], self.shared[i] = self.parent[e], self.shared[e]
            elif self.link[i] == "edited" and last_extension.get(self.parent[i], -1) > i:
                self.parent[i], self.shared[i] = self.replayed[i]
                self.link[i] = "" if self.parent[i] is None else "extends"

    def _turn(self, m: int) -> bytes | None:
        """How m's answer reads when a later prompt replays it as a turn: the end of m's prompt (the
        generation prompt the proxy splices back) and the first sampled tokens."""
        prompt, out = self.prompts[m], self.outputs[m]
        head = out[: min(TURN_TOKENS, len(out) - 1)]
        if self.quota[m] or len(head) == 0:
            return None
        return np.concatenate([prompt[-TURN_TOKENS:], head]).tobytes()

    def _answer(self, m: int) -> bytes | None:
        """What identifies m's answer when it is quoted inside another message: its middle, which
        survives rewrapping (the first and last tokens re-tokenise with new neighbours), or if the
        middle repeats text m was shown, the whole answer less one token at the front and two at
        the end; None if neither is new text of at least `MIN_ANSWER` tokens."""
        out = self.outputs[m]
        for lo, hi in ((len(out) // 4, len(out) - max(2, len(out) // 4)), (1, len(out) - 2)):
            needle = out[lo:hi].tobytes()
            if hi - lo >= MIN_ANSWER and not _find(self.bytes[m], needle):
                return needle
        return None

    def _ends(self, m: int) -> tuple[bytes, bytes] | None:
        """A piece from the head and one from the tail of m's answer (`ANSWER_END` tokens each, off
        the rewrapped edges), for a quote that a harness truncated in the middle (tool output cut to
        its first and last part), which removes the middle `_answer` looks for; None for an answer
        too short for two such pieces or whose pieces repeat text m was shown."""
        out = self.outputs[m]
        if len(out) < 2 * ANSWER_END + 3:
            return None
        head, tail = out[1: 1 + ANSWER_END].tobytes(), out[len(out) - 2 - ANSWER_END: len(out) - 2].tobytes()
        if _find(self.bytes[m], head) or _find(self.bytes[m], tail):
            return None
        return head, tail

    def _tails(self, m: int) -> list[bytes]:
        """Pieces of the last part of m's answer (`TAIL_TOKENS` each, ending `TAIL_PIECES` steps of
        `ANSWER_END` tokens apart, off the rewrapped end), each new text (not in m's prompt), for a
        quote that holds the answer's last part alone, which `_answer`'s middle and `_ends`' head miss."""
        out = self.outputs[m]
        pieces = []
        for k in range(TAIL_PIECES):
            lo = len(out) - 2 - TAIL_TOKENS - k * ANSWER_END
            if lo < 1:
                break
            piece = out[lo: lo + TAIL_TOKENS].tobytes()
            if not _find(self.bytes[m], piece):
                pieces.append(piece)
        return pieces

    def _link(self, i: int, by_length: list[tuple[int, int]]) -> None:
        prompt = self.prompts[i]
        best, best_s = None, -1
        for neg_len, neg_p in by_length:  # longest paths first: the first exact match is the best
            if -neg_len <= best_s:
                break
            p = -neg_p
            need = max(len(self.prompts[p]) - self.slack[p], 1)
            if len(prompt) < need or prompt[need - 1] != self.prompts[p][need - 1]:
                continue
            s = shared_with_path(prompt, self.prompts[p], self.outputs[p])
            if s >= need and (s > best_s or (s == best_s and p > best)):
                best, best_s = p, s
        if best is not None and best_s < len(self.prompts[best]) and not self.holds_turn(i, best):
            self.forked_from[i] = best  # p's history, and then another message instead of p's answer
            best, best_s = None, -1
        if best is not None:
            self.parent[i], self.link[i], self.shared[i] = best, "extends", best_s
            self.replayed[i] = (best, best_s)
        # A later call's turn past the shared prefix, in a call that agrees with it as far: an edit.
        start = best_s if best is not None else 0
        for m in range(i - 1, -1 if best is None else best, -1):
            if not self.holds_turn(i, m, max(start - TURN_TOKENS, 0)):
                continue
            if best is None or _lcp(prompt, self.prompts[m]) >= best_s:
                shared = shared_with_path(prompt, self.prompts[m], self.outputs[m])
                # An edit rewrites the history past the thread's first prompt; a call that keeps less
                # of it (another system prompt, another first request) re-read m's turns in a thread
                # of its own (a memory extractor, a side request), whatever it replays after that.
                # Where it does keep it, an edit and a side call that re-read the history look the
                # same: the proxy's side hint (a header, a summary instruction) decides.
                h = self.head(m)
                if shared < max(len(self.prompts[h]) - self.slack[h], 1) or self.side_hint[i]:
                    continue
                self.parent[i], self.link[i], self.shared[i] = m, "edited", shared
                return

    def head(self, m: int) -> int:
        """The first call of m's thread as linked so far (its first prompt: system prompt and task)."""
        while self.parent[m] is not None:
            m = self.parent[m]
        return m

    def how(self, i: int) -> str:
        """How call i is linked to its parent; a retry, as the call it repeats."""
        while self.retry_of[i] is not None:
            i = self.retry_of[i]
        return self.link[i]

    def holds_turn(self, i: int, m: int, start: int = 0) -> bool:
        return self.turns[m] is not None and _find(self.bytes[i], self.turns[m], start)

    def quote_at(self, i: int, m: int, start: int = 0) -> int:
        """The token position in call i's prompt (from `start`) of m's answer's middle, else of its
        head piece followed by its tail piece (the answer truncated in the middle), else of a piece of
        its last part (`_tails`: the part quoted alone); -1 if none."""
        if self.answers[m] is not None:
            at = token_position(self.bytes[i], self.answers[m], start)
            if at != -1:
                return at
            if self.ends[m] is not None:
                head, tail = self.ends[m]
                at = token_position(self.bytes[i], head, start)
                # Both pieces, the tail after the head: two pieces found by chance are far less likely than one.
                if at != -1 and _find(self.bytes[i], tail, at + ANSWER_END):
                    return at
        for piece in self.tails[m]:
            at = token_position(self.bytes[i], piece, start)
            if at != -1:
                return at
        return -1

    def quotes(self, i: int, m: int, start: int = 0) -> bool:
        """Whether call i holds m's answer other than as m's turn (inside another message)."""
        return self.quote_at(i, m, start) != -1 and not self.holds_turn(i, m)


def reconstruct(calls: Sequence[CallRecord]) -> RolloutThreads:
    """The threads of one rollout's calls (any order); see the module docstring for the rules."""
    calls = sorted(calls, key=lambda c: int(c.call_index))
    if not calls:
        return RolloutThreads([], [], 0, 0, 0)
    if len({c.rollout_id for c in calls}) > 1:
        raise ValueError(f"calls from several rollouts: {sorted({str(c.rollout_id) for c in calls})}")
    if len({int(c.call_index) for c in calls}) < len(calls):
        raise ValueError(f"rollout {calls[0].rollout_id!r}: duplicate call indices")
    r = _Rollout(calls)
    n = len(calls)
    hint = [next((t for t in c.tags if t in _HINTED_SIDE), None) for c in calls]
    kind: list[str | None] = ["quota" if q else None for q in r.quota]
    reason = ["sampled at most one token, stopped on length (a probe)" if q else "" for q in r.quota]
    extends = list(r.parent)
    continued = {r.parent[j] for j in range(n)} | {r.retry_of[j] for j in range(n)}

    # Compactions: a call that replays no prompt whole quotes the answer of a call nobody
    # continued, and shares at least half of the first prompt of the thread that call compacted.
    restart_of: dict[int, int] = {}  # restarted call -> the call its thread continues
    compaction_of: dict[int, int] = {}  # restarted call -> the compaction call whose summary it holds
    thread_root: list[int] = list(range(n))  # the first call of each call's thread so far

    def compacted_thread(c: int, k: int) -> int | None:
        """The call whose thread c restarts from k's summary: the one c continues, which must be the
        one whose history k was given; else k's parent; for a k that continues nothing (its own
        system prompt), the call it read (`read_from`), else the one c shares most with."""
        q = r.parent[k]
        if extends[c] is not None:  # an edited c restarts only the thread k was given
            return extends[c] if q is not None and thread_root[q] == thread_root[extends[c]] else None
        if q is not None:
            return q
        q = read_from(k)
        if q is not None:
            return q
        others = [q for q in range(c) if q != k and kind[q] is None]
        return max(others, key=lambda q: (shared_with_path(r.prompts[c], r.prompts[q], r.outputs[q]), q), default=None)

    def read_from(k: int) -> int | None:
        """The latest call whose turn k holds, else whose answer it quotes. A quoted call that
        continues nothing and that nothing continued is a partial summary (a compaction in stages:
        chunks of the history summarised apart, then merged): it is followed back to what it read."""
        earlier = range(k - 1, -1, -1)
        held = next((q for q in earlier if kind[q] is None and r.holds_turn(k, q)), None)
        if held is not None:
            return held
        q = next((q for q in earlier if kind[q] is None and r.quotes(k, q)), None)
        if q is None:
            return None
        if loose(q):
            src = read_from(q)
            return q if src is None else src
        return q

    def loose(q: int) -> bool:
        """Whether q is an unclassified call that continues nothing and that nothing continued."""
        return kind[q] is None and r.parent[q] is None and q not in continued and q not in restart_of

    def quoted_between(j: int, k: int) -> bool:
        """Whether a call after j and before k quotes j's answer (it came back before k)."""
        return any(r.quotes(m, j) for m in range(j + 1, k))

    merged_into: dict[int, int] = {}  # a partial summary -> the compaction call that summarises it again

    def mark_pieces(k: int, head: int) -> None:
        """The partial summaries compaction call k merges: calls that continue nothing, whose answers
        nothing else took up or quoted before k, and that read the thread k compacted."""
        for j in range(k):
            if loose(j) and r.quotes(k, j) and not quoted_between(j, k):
                src = read_from(j)
                if src is not None and thread_root[src] == head:
                    kind[j], reason[j] = "compaction", f"a partial summary that call {calls[k].call_index} merges"
                    merged_into[j] = k
                    mark_pieces(j, head)

    for c in range(n):
        if r.retry_of[c] is not None and r.retry_of[c] in restart_of:  # a restart asked again
            restart_of[c], extends[c] = restart_of[r.retry_of[c]], None
            compaction_of[c] = compaction_of[r.retry_of[c]]
            thread_root[c] = thread_root[r.retry_of[c]]
            continue
        if extends[c] is not None and r.how(c) != "edited":
            thread_root[c] = thread_root[extends[c]]
            continue
        # Of several quoted answers (a summary, then a subagent's result after it), the first; an
        # answer an earlier call already quoted came back before (a subagent's report) and summarises
        # nothing.
        edited = extends[c] if extends[c] is not None else -1
        quoted = []
        for k in range(edited + 1, c):
            if kind[k] is None and k not in continued:
                at = r.quote_at(c, k)
                if at != -1 and not r.holds_turn(c, k) and not quoted_between(k, c):
                    quoted.append((at, k))
        k = min(quoted)[1] if quoted else None
        if k is None:  # an answer too plain to quote (text its own prompt held): a compaction hint decides
            hinted = [k for k in range(edited + 1, c) if kind[k] is None and k not in continued
                      and hint[k] == "compaction" and r.answers[k] is None and len(r.outputs[k])
                      and _find(r.bytes[c], r.outputs[k].tobytes())]
            k = hinted[-1] if hinted else None
        q = None if k is None else compacted_thread(c, k)
        head = None if q is None else thread_root[q]
        if q is not None and 2 * _lcp(r.prompts[c], r.prompts[head]) >= len(r.prompts[head]):
            kind[k], reason[k] = "compaction", f"its answer restarts the thread in call {calls[c].call_index}"
            restart_of[c], extends[c] = q, None
            compaction_of[c] = k
            thread_root[c] = head
            mark_pieces(k, head)
            continue
        if extends[c] is not None:
            thread_root[c] = thread_root[extends[c]]

    # Chains: union of the links (compactions and probes stand alone).
    chain = list(range(n))

    def root(i: int) -> int:
        while chain[i] != i:
            chain[i] = chain[chain[i]]
            i = chain[i]
        return i

    for c in range(n):
        if kind[c] is not None:
            continue
        for joined in (restart_of.get(c, extends[c]), r.retry_of[c]):
            if joined is not None and kind[joined] is None:
                chain[root(c)] = root(joined)
    members: dict[int, list[int]] = {}
    for c in range(n):
        if kind[c] is None:
            members.setdefault(root(c), []).append(c)
    subagent_of: dict[int, int] = {}
    for head, group in members.items():
        last = group[-1]
        for c in range(last + 1, n):
            p = extends[c]
            if kind[c] != "quota" and (p is not None or c in restart_of or kind[c] == "compaction") and root(c) != head and r.quotes(c, last, max(r.shared[c] - 1, 0)):
                subagent_of[head] = c
                break
    for head, group in members.items():
        # A subagent hint tags one call (an agent-id header, a tool list short of main's that a
        # dropped tool also gives): it names the chain only if most of its calls carry it, as for
        # the ranking below, so one odd call cannot turn the main chain into a subagent.
        if sum(hint[i] == "subagent" for i in group) * 2 > len(group):
            subagent_of.setdefault(head, -1)

    # Main: the longest chain that is not a subagent (hinted side chains only if nothing else), and
    # that did not start by re-reading another chain's turns or answers (a side thread handed them);
    # an answer of a chain of one call handed on is a plan (a planner's, read by the agent that acts).
    def rank(head: int) -> tuple:
        group = members[head]
        hinted = sum(hint[i] is not None for i in group) * 2 > len(group)
        derived = any(kind[m] is None and root(m) != head
                      and (r.holds_turn(head, m) or (r.quotes(head, m) and len(members.get(root(m), ())) > 1))
                      for m in range(head))
        # Of chains as long, the one shown more (the harness's system prompt and tools: a side call
        # is asked with a short prompt of its own), then the one that did more (side calls ask for a
        # few tokens, though a main answer may be shorter still: "4"); the order the calls finished
        # in says nothing of which thread did the task, so it comes last.
        sampled = sum(len(r.outputs[i]) for i in group)
        shown = max(len(r.prompts[i]) for i in group)
        return (head not in subagent_of, not hinted, not derived, len(group), shown, sampled, group[-1])

    def asked_aside(i: int, group: list[int]) -> bool:
        """Whether a later call of the chain goes on from the call i extends, replacing what i added
        (a next-speaker check, a question put to the whole history); a later call that keeps i's
        added message (the harness dropped a message i had, and asked again) or holds i's answer
        (an edit of the message before it hid i's turn) does not count."""
        p = extends[i]
        path = len(r.prompts[p]) + len(r.outputs[p])
        return any(extends[j] == p and r.how(j) == "extends" and _lcp(r.prompts[i], r.prompts[j]) <= path + TURN_TOKENS
                   and not took_up(j, i) for j in group if j > i)

    def took_up(j: int, i: int) -> bool:
        """Whether call j holds i's answer, as i's turn or anywhere (the turn may have been edited)."""
        return r.holds_turn(j, i) or r.quote_at(j, i) != -1

    main_head = max(members, key=rank) if members else None
    thread = [""] * n
    for head, group in members.items():
        if head == main_head:
            for i in group:
                thread[i], kind[i], reason[i] = "main", "main", "the main chain"
            continued |= set(restart_of.values())
            for i in group:
                if r.link[i] == "edited" and i != group[-1] and i not in continued:
                    kind[i], reason[i] = "summary", "an edited one-off that its chain went on without"
                    thread[i] = f"summary:{calls[i].call_index}"
                elif r.how(i) == "extends" and i not in continued and asked_aside(i, group):
                    kind[i], reason[i] = "summary", "a one-off that asked something else of the history, which went on without it"
                    thread[i] = f"summary:{calls[i].call_index}"
            last = group[-1]
            if hint[last] == "compaction" and kind[last] == "main":
                kind[last], reason[last] = "compaction", "the main chain's last call, hinted compaction"
                thread[last] = f"compaction:{calls[last].call_index}"
            continue
        if head in subagent_of:
            consumer = subagent_of[head]
            why = (f"its last answer returns in call {calls[consumer].call_index}" if consumer >= 0
                   else "hinted subagent (harness header or marker)")
            k, label = "subagent", why
        elif len(group) == 1:
            i = group[0]
            holds = r.parent[i] is not None or any(r.quotes(i, m) or r.holds_turn(i, m) for m in range(i))
            k, label = (("summary", "a one-off that re-reads earlier answers") if holds
                        else ("title", "a one-off asked from the task alone"))
            if hint[i] in ("title", "compaction", "quota") and hint[i] != k:
                k, label = hint[i], f"a one-off, hinted {hint[i]}"
        else:
            k, label = "other-side", "a side chain that no other call takes up"
        for i in group:
            thread[i], kind[i], reason[i] = f"{k}:{calls[head].call_index}", k, label
    for i in range(n):
        if not thread[i]:
            thread[i] = f"{kind[i]}:{calls[i].call_index}"

    # Main-thread continuity and divergences.
    divergences: list[Divergence] = []
    pairs = exact = drift = 0
    for i in range(n):
        if kind[i] != "main":
            continue
        if i in restart_of:
            m = restart_of[i]
            s = shared_with_path(r.prompts[i], r.prompts[m], r.outputs[m])
            divergences.append(Divergence(calls[i].call_index, calls[m].call_index, s, "compaction"))
            continue
        p = extends[i]
        if p is None or kind[p] != "main":
            continue
        pairs += 1
        path_len = len(r.prompts[p]) + len(r.outputs[p])
        s = r.shared[i]
        drift += path_len - s
        if s == path_len:
            exact += 1
            continue
        cause = "history edit" if r.how(i) == "edited" else "template re-render"
        divergences.append(Divergence(calls[i].call_index, calls[p].call_index, s, cause))

    # Links: a subagent's last call to the call its answer returns in; a compaction call (of the main
    # thread or a subagent's), and the main thread's last call before the restart, to the restart (of a
    # restart asked again, the last);
    # a compaction call to the compaction call that summarises its summary again.
    found: dict[tuple[str, int], int] = {}
    # A call asked again on the same prompt (cut short, dropped) is superseded by its last retry, which
    # the thread goes on from: a link into it goes there (into the dead call, its credit was lost).
    first_asked = []
    for i in range(n):
        first = i
        while r.retry_of[first] is not None:
            first = r.retry_of[first]
        first_asked.append(first)
    last_asked = {first: i for i, first in enumerate(first_asked)}  # ascending: the last call wins
    for head, c in subagent_of.items():
        if c >= 0 and kind[head] == "subagent":
            found[("returns", members[head][-1])] = last_asked[first_asked[c]]
    for j, k in merged_into.items():
        if kind[k] == "compaction":
            found[("restarts", j)] = k
    for c, k in compaction_of.items():
        # c restarts the thread, or is a compaction call summarising k's summary again (compacting in
        # pieces): the chain goes on there
        if kind[k] != "compaction" or kind[c] not in ("main", "subagent", "compaction"):
            continue
        found[("restarts", k)] = c
        if kind[c] == "main":
            # the main thread's last call before the restart (not the restart itself asked before)
            before = [i for i in range(c) if kind[i] == "main" and compaction_of.get(i) != k]
            if before:
                found[("resumes", before[-1])] = c
    links = sorted((Link(how, int(calls[src].call_index), int(calls[dst].call_index)) for (how, src), dst in found.items()),
                   key=lambda lk: (lk.target, lk.source))
    out = [
        CallThread(int(c.call_index), thread[i], kind[i], None if extends[i] is None else int(calls[extends[i]].call_index), reason[i])
        for i, c in enumerate(calls)
    ]
    return RolloutThreads(out, divergences, pairs, exact, drift, links)


def trained_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    """The thread kinds a run trains (`algorithm.train_threads`), checked: known kinds, "main" among
    them, none twice; returned in `KINDS` order. Raises ValueError naming what is wrong."""
    kinds = list(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown thread kind(s) {bad}: each must be one of {list(KINDS)}")
    if "main" not in kinds:
        raise ValueError(f"must include 'main' (the thread the task is done in), got {kinds}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"lists a kind twice: {kinds}")
    return tuple(k for k in KINDS if k in kinds)


def with_kinds(calls: Sequence[CallRecord], threads: RolloutThreads) -> list[CallRecord]:
    """The calls with their tags set to their reconstructed kind (what `build_tree` excludes by)."""
    kinds = threads.kind_of()
    return [c if c.tags == (kinds[c.call_index],) else dataclasses.replace(c, tags=(kinds[c.call_index],)) for c in calls]


def fidelity_counts(threads: Sequence[RolloutThreads]) -> dict[str, float]:
    """A batch's main-thread fidelity, for the trainer's metrics: continuity over all its main pairs
    (1.0 with none), drift tokens, divergences, and the side calls kept out of the loss."""
    pairs = sum(t.main_pairs for t in threads)
    return {
        "main_continuity": sum(t.exact_pairs for t in threads) / pairs if pairs else 1.0,
        "main_pairs": pairs,
        "main_drift_tokens": sum(t.drift for t in threads),
        "main_divergences": sum(len(t.divergences) for t in threads),
        "side_calls": sum(c.kind != "main" for t in threads for c in t.calls),
    }
