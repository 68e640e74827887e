// Causal or full scaled-dot-product attention on the CPU (Note [CPU attention]).
#include "meshtrain/model/attention.h"
#include "meshtrain/model/fused/kernels.h"
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/model/fused/tensor_args.h"
#include "meshtrain/util/cpu_features.h"

#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace meshtrain::model::fused {

// Note [CPU attention]
// ATen's CPU attention is a flash kernel: it walks blocks of keys with an
// online softmax and keeps only the row statistics. Without AMX its bf16
// variant is slower than its fp32 one, and both are slower than the same
// arithmetic as batched matrix multiplies, which oneDNN and MKL run near the
// matmul peak: for fwd + bwd of [8, 6, 256, 64] on 2 cores, the six products
// take 8 ms in bf16 (AVX512-BF16 dot products) against ATen's 27, and 17 ms in
// fp32 against 22. AMX speeds up ATen's bf16 forward (1.5 ms at that shape)
// but not its backward (11.3 ms, fp32's 9.9); on such a CPU this path took
// the `small` bf16 step's attention from about 173 to 71 ms. So on the CPU,
// in either dtype:
//   forward   s = q·kᵀ (bmm)  p = softmax(scale·s, causal) (one fused pass, in
//             place)  y = p·v (bmm)
//   backward  dp = dy·vᵀ, dv = pᵀ·dy (bmm)  ds = scale·p·(dp − rowsum(p·dp))
//             (one fused pass, in place)  dq = ds·k, dk = dsᵀ·q (bmm)
// Causal with as many queries as keys, the rows split into n blocks of about
// 64 queries (n = T/64 rounded up, at least 2): block i's queries see only
// the keys up to its last one, so its products cover [T/n, (i+1)·T/n] and all
// of them (n+1)/2n of T², not the masked rest: 3/4 at two blocks (fwd + bwd
// alone: fp32 14.4 ms against 17.4 whole, bf16 the same; in the `small` step
// 7% more tokens/s in either), 5/8 at four (T = 256: the six products of a
// Llama block 2.20 to 1.96 ms a micro-batch; smaller blocks than 64 queries
// run slower again). Under bf16 the blocks are of about 128 queries: oneDNN's
// bf16 products cost more per call than MKL's fp32 ones, and in the `small`
// bf16 step (T = 256) two blocks ran 3% faster than four (9,140 against 8,873
// tokens/s, medians of 5 alternating runs, 2 cores of an AMD EPYC). Entries past a causal
// query's position inside a block are written as zeros and skipped by the
// softmax passes, and so are those before a sliding window (Mistral, Gemma
// 2's local blocks: the products still cover every key up to the query) and
// those before a packed row's document start (Batch::documents: a query's
// first key is the later of its window's and its document's first).
// Gemma 2's soft-cap c·tanh(z/c) is applied inside the forward pass; its
// backward needs tanh of the scores, which p cannot give back, so it forms
// each block's q·kᵀ again (a seventh product, no T² tensor kept): in the
// Gemma 2 family benchmark 1.30x transformers against 1.10x through ATen's
// explicit scores. p is kept for backward, in the compute dtype: [B·H, (n+1)T²/2n]
// causal, no more than q, k, v and y together while T ≤ 4·d, the longest key
// range taken here (longer ones take ATen's kernel: p would grow as T²). Under
// bf16 the scores are rounded to bf16 before the softmax (fp32 accumulation
// inside the product): the precision of PyTorch's math attention, not its flash
// kernel's; the softmax itself is fp32. Dropout and GPUs take ATen's kernel;
// on the CPU bf16 then computes it in fp32, unless ATen's bf16 kernel takes
// AMX (aten_bf16_attention_on_amx). The planner counts the copies of
// q, k, v and p (attention = "batched", plan/from_config.cpp,
// batched_attention_scores()).
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using namespace detail;

// The softmax's scale for heads of size d.
float scale_for(int64_t head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

// The blocks of queries the causal split makes (Note [CPU attention]): block i
// holds queries edges[i] .. edges[i + 1] − 1 and sees keys 0 .. edges[i + 1] − 1;
// {0, q_len} (one block, every key) where there is no split.
std::vector<int64_t> causal_blocks(int64_t q_len, int64_t k_len, bool causal, bool bf16) {
  if (!causal || q_len != k_len || q_len < 2) return {0, q_len};
  const int64_t queries = bf16 ? 128 : 64;
  const int64_t n = std::max<int64_t>(2, (q_len + queries - 1) / queries);
  std::vector<int64_t> edges;
  for (int64_t i = 0; i <= n; ++i) edges.push_back(i * q_len / n);
  return edges;
}

// [B, H, T, d] as [B·H, T, d] in `type` (a copy where the view cannot be).
at::Tensor batched(const at::Tensor& x, at::ScalarType type) {
  return x.to(type).reshape({x.size(0) * x.size(1), x.size(2), x.size(3)});
}

// An operand of the blocks' products: a bf16 product (oneDNN's) copies any
// operand whose matrices are not packed one after another, a narrowed k or v
// or a block of q rows, and where the operand is a transposed view the copy
// transposes, which costs more than the product (k's [48, 128, 64] for q·kᵀ
// on 2 cores: 0.24 ms with ATen's copy against 0.12 packed first). So a bf16
// operand is packed here, before any transpose; fp32 products (MKL's) take
// the strides as they are.
at::Tensor packed(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16 ? x.contiguous() : x; }

// Rows `from`..`from + n` of every query head of a group, [B·Hkv, G, T, d], as
// the rows of one product, [B·Hkv, G·n, d] (a view where G = 1 or all rows).
at::Tensor group_rows(const at::Tensor& grouped, int64_t from, int64_t n) {
  return grouped.narrow(2, from, n).reshape({grouped.size(0), grouped.size(1) * n, grouped.size(3)});
}

// What the softmax passes of a block compute beside the product: its rows are
// a group's heads one after another, `q_len` queries each, at key positions
// key_offset + i; `documents` (undefined: none) as Batch::documents.
struct Pass {
  float scale, softcap;
  bool causal;
  int64_t key_offset, window, q_len;
  const at::Tensor& documents;
};

// The rows of a block's scores [n, rows, k_len] under `pass`.
kernel::ScoreRows score_rows(const at::Tensor& scores, const Pass& pass) {
  kernel::ScoreRows r;
  r.k_len = scores.size(2);
  r.rows = scores.numel() / r.k_len;
  r.q_len = pass.q_len;
  r.causal = pass.causal;
  r.key_offset = pass.key_offset;
  r.window = pass.window;
  if (pass.documents.defined()) {
    r.documents = pass.documents.const_data_ptr<int64_t>();
    r.batch_rows = r.rows / pass.documents.size(0);
    r.columns = pass.documents.size(1);
  }
  return r;
}

// One block of rows: p = softmax(scale · q·kᵀ, soft-capped).
at::Tensor block_softmax(const at::Tensor& q, const at::Tensor& k, const Pass& pass) {
  const at::Tensor p = at::bmm(q, packed(k).transpose(1, 2));
  kernel::table().attention_softmax_forward(score_rows(p, pass), p.const_data_ptr(), dt(p), pass.scale, pass.softcap,
                                            p.mutable_data_ptr(), dt(p));
  return p;
}

struct BlockGrads {
  at::Tensor dq, dk, dv;
};

// The gradients one block of rows (p from block_softmax) sends to its q rows,
// and to the k and v rows it saw (summed over the group's heads by the products).
BlockGrads block_backward(const at::Tensor& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& dy, const Pass& pass) {
  BlockGrads g;
  const at::Tensor kp = packed(k);
  g.dv = at::bmm(p.transpose(1, 2), dy);
  const at::Tensor ds = at::bmm(dy, packed(v).transpose(1, 2));  // dp, then ds in place
  // A soft-cap's derivative needs the scores: computed again (one product), not kept.
  const at::Tensor s = pass.softcap > 0 ? at::bmm(q, kp.transpose(1, 2)) : at::Tensor();
  kernel::table().attention_softmax_backward(score_rows(ds, pass), p.const_data_ptr(), dt(p), ds.const_data_ptr(),
                                             dt(ds), s.defined() ? s.const_data_ptr() : nullptr,
                                             s.defined() ? dt(s) : dt(p), pass.scale, pass.softcap,
                                             ds.mutable_data_ptr(), dt(ds));
  g.dq = at::bmm(ds, kp);
  g.dk = at::bmm(ds.transpose(1, 2), q);
  return g;
}

// Note [Grouped queries]
// With grouped-query attention (Hkv key/value heads, each serving G = H/Hkv
// query heads, head j the heads jG..jG+G-1 as repeat_interleave orders them)
// the products take a group's G query heads as the rows of one matrix,
// [B·Hkv, G·T, d], against its one k and v: no copy of k and v per query head,
// and backward's pᵀ·dy and dsᵀ·q sum the group's gradients inside the product.
// The causal split takes each head's rows of one block at a time: q and dy are
// copied into the blocks' order (one q-sized copy each, where repeating k and
// v cost two forward and their sums backward); with G = 1 these are views in
// fp32, and under bf16 q's blocks are packed copies (packed()).
struct BatchedAttention : torch::autograd::Function<BatchedAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, int64_t window, double score_scale, double softcap,
                            const std::optional<at::Tensor>& starts) {
    RECORD_FUNCTION("meshtrain::fused_attention", std::vector<c10::IValue>());
    const at::ScalarType type = compute_dtype(q.scalar_type());
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const at::Tensor kb = batched(k, type), vb = batched(v, type);
    const at::Tensor documents = starts.value_or(at::Tensor());
    const int64_t q_len = q.size(2), k_len = k.size(2), n = kb.size(0), d = v.size(3);
    const std::vector<int64_t> edges = causal_blocks(q_len, k_len, causal, type == at::kBFloat16);
    const int64_t groups = q.size(1) / k.size(1);
    const at::Tensor qg = batched(q, type).view({n, groups, q_len, q.size(3)});
    const float scale = score_scale > 0 ? static_cast<float>(score_scale) : scale_for(q.size(3));
    const float cap = static_cast<float>(softcap);
    // y in the layout the output projection reads, [B, T, H, d], each block's
    // rows written into it: returned as its [B, H, T, d] view, whose
    // transpose back is a view, not a copy.
    const int64_t batch = q.size(0), kv_heads = k.size(1);
    const at::Tensor y = at::empty({batch, q_len, q.size(1), d}, vb.options());
    const at::Tensor y_heads = y.view({batch, q_len, kv_heads, groups, d}).permute({0, 2, 3, 1, 4});
    variable_list saved = {kb, vb};  // then each block's query rows and softmax
    for (size_t i = 0; i + 1 < edges.size(); ++i) {
      const int64_t from = edges[i], rows = edges[i + 1] - from, keys = edges.size() > 2 ? edges[i + 1] : k_len;
      const at::Tensor block = packed(group_rows(qg, from, rows));  // saved as it is, for backward's dsᵀ·q
      const at::Tensor p = block_softmax(block, kb.narrow(1, 0, keys), {scale, cap, causal, from, window, rows, documents});
      const at::Tensor out = at::bmm(p, packed(vb.narrow(1, 0, keys)));
      y_heads.narrow(3, from, rows).copy_(out.view({batch, kv_heads, groups, rows, d}));
      saved.push_back(block);
      saved.push_back(p);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["edges"] = edges;
    ctx->saved_data["q_len"] = q_len;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window"] = window;
    if (documents.defined()) ctx->saved_data["documents"] = documents;
    ctx->saved_data["scale"] = static_cast<double>(scale);
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["types"] = std::vector<int64_t>{int64_t(q.scalar_type()), int64_t(k.scalar_type()),
                                                    int64_t(v.scalar_type())};
    return y.transpose(1, 2);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("meshtrain::fused_attention_backward", std::vector<c10::IValue>());
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const variable_list saved = ctx->get_saved_variables();
    const std::vector<int64_t> types = ctx->saved_data["types"].toIntVector();
    const bool causal = ctx->saved_data["causal"].toBool();
    const int64_t window = ctx->saved_data["window"].toInt();
    const auto kept = ctx->saved_data.find("documents");
    const at::Tensor documents = kept == ctx->saved_data.end() ? at::Tensor() : kept->second.toTensor();
    const std::vector<int64_t> edges = ctx->saved_data["edges"].toIntVector();
    const int64_t q_len = ctx->saved_data["q_len"].toInt();
    const float scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    const float cap = static_cast<float>(ctx->saved_data["softcap"].toDouble());
    const at::Tensor& dy4 = grads[0];
    const at::Tensor &kb = saved[0], &vb = saved[1];
    const int64_t n = kb.size(0), groups = dy4.size(1) / (n / dy4.size(0)), d = dy4.size(3);
    // dy's rows of a block as one product's rows, copied once from whatever strides dy has
    // (the output projection's backward hands them in [B, T, H, d] order).
    const at::Tensor dy_heads = dy4.view({dy4.size(0), n / dy4.size(0), groups, q_len, d});
    auto dy_rows = [&](int64_t from, int64_t rows) {
      return dy_heads.narrow(3, from, rows).to(saved[3].scalar_type()).reshape({n, groups * rows, d});
    };
    // The last block sees every key: its dk and dv are whole, the others' are added into their first rows.
    const size_t blocks = edges.size() - 1;
    BlockGrads g;
    variable_list dq(blocks);
    for (size_t i = blocks; i-- > 0;) {
      const int64_t from = edges[i], rows = edges[i + 1] - from, keys = blocks > 1 ? edges[i + 1] : kb.size(1);
      const BlockGrads b = block_backward(saved[3 + 2 * i], saved[2 + 2 * i], kb.narrow(1, 0, keys),
                                          vb.narrow(1, 0, keys), dy_rows(from, rows),
                                          {scale, cap, causal, from, window, rows, documents});
      dq[i] = b.dq.view({n, groups, rows, saved[2 + 2 * i].size(2)});
      if (i + 1 == blocks) {
        g = b;
      } else {
        g.dk.narrow(1, 0, keys).add_(b.dk);
        g.dv.narrow(1, 0, keys).add_(b.dv);
      }
    }
    g.dq = blocks == 1 ? dq[0] : at::cat(dq, 2);
    auto shaped = [&](const at::Tensor& t, int64_t heads, int64_t type) {
      return t.reshape({dy4.size(0), heads, -1, t.size(-1)}).to(static_cast<at::ScalarType>(type));
    };
    const int64_t kv_heads = g.dk.size(0) / dy4.size(0);
    return {shaped(g.dq, dy4.size(1), types[0]), shaped(g.dk, kv_heads, types[1]), shaped(g.dv, kv_heads, types[2]),
            {}, {}, {}, {}, {}};
  }
};

}  // namespace

namespace {

// ATen's bf16 flash kernel takes AMX where the CPU has it, through code of its
// AVX-512 build only: with ATEN_CPU_CAPABILITY below that it throws.
bool aten_bf16_attention_on_amx() {
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  return util::cpu_has_amx() && (cap == nullptr || *cap == '\0' || std::string(cap).rfind("avx512", 0) == 0);
}

}  // namespace

bool batched_attention_applies(bool cpu, int64_t keys, int64_t head_dim, double dropout) {
  return cpu && dropout == 0.0 && keys <= 4 * head_dim;
}

int64_t batched_attention_scores(int64_t q_len, int64_t k_len, bool causal, bool bf16) {
  const std::vector<int64_t> edges = causal_blocks(q_len, k_len, causal, bf16);
  if (edges.size() == 2) return q_len * k_len;
  int64_t scores = 0;
  for (size_t i = 0; i + 1 < edges.size(); ++i) scores += (edges[i + 1] - edges[i]) * edges[i + 1];
  return scores;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout, bool causal,
                     int64_t window, double scale, double softcap, const at::Tensor& documents) {
  const bool bf16 = compute_dtype(q.scalar_type()) == at::kBFloat16;
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0 && v.size(1) == k.size(1),
              "fused::attention: the query heads (", q.size(1), ") must be a multiple of the key/value heads (", k.size(1),
              ", ", v.size(1), ")");
  TORCH_CHECK(!documents.defined() || (causal && documents.dim() == 2 && documents.size(0) == q.size(0) &&
                                       documents.size(1) == q.size(2) && q.size(2) == k.size(2)),
              "fused::attention: documents [batch, columns] need causal attention with as many queries as keys");
  const at::Tensor starts = documents.defined() ? documents.to(q.device(), at::kLong).contiguous() : documents;
  if (starts.defined()) {  // the kernel reads keys from each start: none past its own column
    const at::Tensor columns = at::arange(starts.size(1), starts.options());
    TORCH_CHECK(starts.ge(0).logical_and(starts.le(columns)).all().item<bool>(),
                "fused::attention: a document starts after its own column or before 0");
  }
  if (eligible(q) && eligible(k) && eligible(v) &&
      batched_attention_applies(q.device().is_cpu(), k.size(2), q.size(3), dropout)) {
    return BatchedAttention::apply(q, k, v, causal, causal ? window : 0, scale, softcap,
                                   starts.defined() ? std::optional<at::Tensor>(starts) : std::nullopt);
  }
  TORCH_CHECK(softcap == 0, "fused::attention: soft-capped scores take the batched path only (batched_attention_applies)");
  // ATen's: a sliding window and documents as a boolean mask.
  at::Tensor mask;
  if (causal && (window > 0 || starts.defined())) {  // queries at the last of the keys' columns
    const at::TensorOptions columns = at::TensorOptions(at::kLong).device(q.device());
    const int64_t t = q.size(2), keys = k.size(2);
    AttentionSpec spec;
    spec.window = window;
    mask = allowed_pairs(at::arange(keys - t, keys, columns), at::arange(keys, columns), spec);
    if (starts.defined()) mask = mask.logical_and(same_document(starts, starts));
  }
  const bool is_causal = causal && !mask.defined();
  const SdpaKeys g = sdpa_keys(q, k, v, mask.defined());  // Note [Grouped queries in SDPA]
  const std::optional<at::Tensor> attn_mask = mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
  const std::optional<double> score_scale = scale > 0 ? std::optional<double>(scale) : std::nullopt;
  if (!q.device().is_cpu() || !bf16 || aten_bf16_attention_on_amx()) {
    return at::scaled_dot_product_attention(q, g.k, g.v, attn_mask, dropout, is_causal, score_scale, g.enable_gqa);
  }
  // Without AMX (or capped below its AVX-512 code) ATen's bf16 kernel is slower than its fp32 one, or
  // throws: compute in fp32, out of autocast's reach.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const at::Tensor y = at::scaled_dot_product_attention(q.to(at::kFloat), g.k.to(at::kFloat), g.v.to(at::kFloat),
                                                        attn_mask, dropout, is_causal, score_scale, g.enable_gqa);
  return y.to(compute_dtype(q.scalar_type()));
}

}  // namespace meshtrain::model::fused
