// Thin pybind11 layer over the prefix tree and packer: converts numpy buffers, validates every
// index the algorithms will follow (so malformed input raises ValueError, never a crash), releases
// the GIL for the work and hands the result vectors to numpy without copying.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "packer.hpp"
#include "prefix_tree.hpp"

namespace py = pybind11;

namespace {

template <class T>
using Arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <class T>
Arr<T> vec(const Arr<T>& a, const char* name) {
    if (a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be one-dimensional");
    return a;
}

template <class T>
py::array_t<T> to_numpy(std::vector<T>&& v) {
    auto* owned = new std::vector<T>(std::move(v));
    py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
    return py::array_t<T>({static_cast<py::ssize_t>(owned->size())}, {static_cast<py::ssize_t>(sizeof(T))},
                          owned->data(), free_when_done);
}

// A macro so the message (often built with std::string concatenation) is only built on failure.
#define REQUIRE(ok, what)                                   \
    do {                                                    \
        if (!(ok)) throw std::invalid_argument(what);       \
    } while (0)

// Offsets must start at 0, never decrease and end at `total`.
void check_offsets(const int64_t* off, int64_t n, int64_t total, const char* name) {
    REQUIRE(off[0] == 0, std::string(name) + "[0] must be 0");
    for (int64_t i = 0; i < n; ++i) REQUIRE(off[i] <= off[i + 1], std::string(name) + " must be non-decreasing");
    REQUIRE(off[n] == total, std::string(name) + " must end at " + std::to_string(total));
}

py::dict build_tree(Arr<int32_t> ids, Arr<int64_t> path_off, Arr<int64_t> prompt_len, Arr<float> infer_logprobs,
                    Arr<int64_t> call_index, Arr<uint8_t> excluded, bool drop_dead) {
    vec(ids, "ids");
    vec(path_off, "path_off");
    vec(prompt_len, "prompt_len");
    vec(infer_logprobs, "infer_logprobs");
    vec(call_index, "call_index");
    vec(excluded, "excluded");
    const int64_t n = prompt_len.shape(0);
    REQUIRE(n > 0, "a tree needs at least one call");
    REQUIRE(path_off.shape(0) == n + 1, "path_off must have one more entry than prompt_len");
    REQUIRE(call_index.shape(0) == n && excluded.shape(0) == n, "call_index and excluded need one entry per call");
    const int64_t* off = path_off.data();
    const int64_t* pl = prompt_len.data();
    const int64_t* ci = call_index.data();
    check_offsets(off, n, ids.shape(0), "path_off");
    int64_t n_out = 0;
    for (int64_t c = 0; c < n; ++c) {
        REQUIRE(pl[c] >= 1 && pl[c] <= off[c + 1] - off[c], "call " + std::to_string(ci[c]) + ": prompt length out of range");
        REQUIRE(ci[c] >= 0 && ci[c] <= INT32_MAX, "call indices must lie in [0, 2^31)");
        REQUIRE(c == 0 || ci[c - 1] < ci[c], "call indices must be strictly increasing");
        n_out += off[c + 1] - off[c] - pl[c];
    }
    REQUIRE(infer_logprobs.shape(0) == n_out, "infer_logprobs must hold one entry per output token");
    REQUIRE(ids.shape(0) < INT32_MAX, "too many tokens for int32 offsets");
    const int32_t* t = ids.data();
    for (int64_t c = 0; c < n; ++c)
        for (int64_t i = off[c]; i < off[c + 1]; ++i)
            REQUIRE(t[i] >= 0, "call " + std::to_string(ci[c]) + ": negative token id " + std::to_string(t[i]));

    clawfast::TreeInput in;
    in.ids = t;
    in.path_off = off;
    in.prompt_len = pl;
    in.infer_logprobs = infer_logprobs.data();
    in.call_index = ci;
    in.excluded = excluded.data();
    in.n = n;
    in.drop_dead = drop_dead;
    clawfast::TreeOutput out;
    {
        py::gil_scoped_release release;
        out = clawfast::build_prefix_tree(in);
    }
    py::dict d;
    d["seg_parent"] = to_numpy(std::move(out.seg_parent));
    d["seg_start"] = to_numpy(std::move(out.seg_start));
    d["seg_len"] = to_numpy(std::move(out.seg_len));
    d["seg_depth"] = to_numpy(std::move(out.seg_depth));
    d["seg_kind"] = to_numpy(std::move(out.seg_kind));
    d["tokens"] = to_numpy(std::move(out.tokens));
    d["infer_logprobs"] = to_numpy(std::move(out.infer_logprobs));
    d["token_call"] = to_numpy(std::move(out.token_call));
    d["end_node"] = to_numpy(std::move(out.end_node));
    d["leaf_node"] = to_numpy(std::move(out.leaf_node));
    d["leaf_depth"] = to_numpy(std::move(out.leaf_depth));
    d["leaf_status"] = to_numpy(std::move(out.leaf_status));
    d["leaf_call_off"] = to_numpy(std::move(out.leaf_call_off));
    d["leaf_calls"] = to_numpy(std::move(out.leaf_calls));
    d["num_unique_tokens"] = out.num_unique_tokens;
    d["num_flat_tokens"] = out.num_flat_tokens;
    d["num_call_tokens"] = out.num_call_tokens;
    return d;
}

py::dict pack_forest(Arr<int64_t> seg_off, Arr<int32_t> seg_parent, Arr<int32_t> seg_start, Arr<int32_t> seg_len,
                     Arr<uint8_t> seg_train, Arr<int64_t> tok_off, Arr<int32_t> tokens, Arr<float> infer_logprobs,
                     Arr<int32_t> token_call, Arr<int64_t> leaf_off, Arr<int32_t> leaf_node, Arr<uint8_t> leaf_kept,
                     int64_t micro_batch_tokens) {
    for (auto* a : {&seg_off, &tok_off, &leaf_off}) vec(*a, "offsets");
    for (auto* a : {&seg_parent, &seg_start, &seg_len, &tokens, &token_call, &leaf_node}) vec(*a, "int32 arrays");
    vec(seg_train, "seg_train");
    vec(leaf_kept, "leaf_kept");
    vec(infer_logprobs, "infer_logprobs");
    REQUIRE(micro_batch_tokens >= 1, "micro_batch_tokens must be positive");
    const int64_t R = seg_off.shape(0) - 1;
    REQUIRE(R >= 0 && tok_off.shape(0) == R + 1 && leaf_off.shape(0) == R + 1, "offsets need one entry per tree plus one");
    const int64_t S = seg_parent.shape(0), N = tokens.shape(0), L = leaf_node.shape(0);
    REQUIRE(seg_start.shape(0) == S && seg_len.shape(0) == S && seg_train.shape(0) == S, "segment arrays differ in length");
    REQUIRE(infer_logprobs.shape(0) == N && token_call.shape(0) == N, "token arrays differ in length");
    REQUIRE(leaf_kept.shape(0) == L, "leaf arrays differ in length");
    if (R == 0) {
        REQUIRE(S == 0 && N == 0 && L == 0, "arrays given without trees");
    } else {
        check_offsets(seg_off.data(), R, S, "seg_off");
        check_offsets(tok_off.data(), R, N, "tok_off");
        check_offsets(leaf_off.data(), R, L, "leaf_off");
    }
    REQUIRE(N < INT32_MAX && S < INT32_MAX, "too many tokens for int32 rows");
    const int64_t *so = seg_off.data(), *to = tok_off.data(), *lo = leaf_off.data();
    const int32_t *sp = seg_parent.data(), *ss = seg_start.data(), *sl = seg_len.data(), *ln = leaf_node.data();
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n_seg = so[r + 1] - so[r], n_tok = to[r + 1] - to[r];
        for (int64_t s = 0; s < n_seg; ++s) {
            const int64_t g = so[r] + s;
            REQUIRE(sp[g] >= -1 && sp[g] < s, "tree " + std::to_string(r) + ": a segment's parent must precede it (DFS pre-order)");
            REQUIRE(sl[g] >= 1 && ss[g] >= 0 && ss[g] + static_cast<int64_t>(sl[g]) <= n_tok,
                    "tree " + std::to_string(r) + ": segment token range out of bounds");
        }
        for (int64_t l = lo[r]; l < lo[r + 1]; ++l)
            REQUIRE(ln[l] >= 0 && ln[l] < n_seg, "tree " + std::to_string(r) + ": leaf node out of range");
    }

    clawfast::PackInput in;
    in.num_trees = R;
    in.seg_off = so;
    in.seg_parent = sp;
    in.seg_start = ss;
    in.seg_len = sl;
    in.seg_train = seg_train.data();
    in.tok_off = to;
    in.tokens = tokens.data();
    in.infer_logprobs = infer_logprobs.data();
    in.token_call = token_call.data();
    in.leaf_off = lo;
    in.leaf_node = ln;
    in.leaf_kept = leaf_kept.data();
    in.micro_batch_tokens = micro_batch_tokens;
    clawfast::PackOutput out;
    {
        py::gil_scoped_release release;
        out = clawfast::pack_forest(in);  // std::invalid_argument -> ValueError
    }
    py::dict d;
    d["row_off"] = to_numpy(std::move(out.row_off));
    d["tgt_off"] = to_numpy(std::move(out.tgt_off));
    d["leaf_off"] = to_numpy(std::move(out.leaf_off));
    d["input_ids"] = to_numpy(std::move(out.input_ids));
    d["position_ids"] = to_numpy(std::move(out.position_ids));
    d["kv_end"] = to_numpy(std::move(out.kv_end));
    d["parent_row"] = to_numpy(std::move(out.parent_row));
    d["is_context"] = to_numpy(std::move(out.is_context));
    d["target_rows"] = to_numpy(std::move(out.target_rows));
    d["target_ids"] = to_numpy(std::move(out.target_ids));
    d["target_rollout"] = to_numpy(std::move(out.target_rollout));
    d["target_leaf"] = to_numpy(std::move(out.target_leaf));
    d["target_call"] = to_numpy(std::move(out.target_call));
    d["infer_logprobs"] = to_numpy(std::move(out.infer_logprobs));
    d["leaf_rows"] = to_numpy(std::move(out.leaf_rows));
    d["leaf_rollout"] = to_numpy(std::move(out.leaf_rollout));
    d["leaf_index"] = to_numpy(std::move(out.leaf_index));
    return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "clawfast C++ core: prefix tree, leaf filter, packer (use clawfast.tree / clawfast.pack)";
    m.def("build_tree", &build_tree, py::arg("ids"), py::arg("path_off"), py::arg("prompt_len"), py::arg("infer_logprobs"),
          py::arg("call_index"), py::arg("excluded"), py::arg("drop_dead"),
          "Prefix tree of one rollout's calls (sorted by call index), as a dict of numpy arrays.");
    m.def("pack_forest", &pack_forest, py::arg("seg_off"), py::arg("seg_parent"), py::arg("seg_start"),
          py::arg("seg_len"), py::arg("seg_train"), py::arg("tok_off"), py::arg("tokens"), py::arg("infer_logprobs"),
          py::arg("token_call"), py::arg("leaf_off"), py::arg("leaf_node"), py::arg("leaf_kept"),
          py::arg("micro_batch_tokens"),
          "Merged, split and packed micro-batches, concatenated, as a dict of numpy arrays.");
}
