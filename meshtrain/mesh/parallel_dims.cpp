#include "meshtrain/mesh/parallel_dims.h"

#include <algorithm>
#include <tuple>

namespace meshtrain::mesh {

namespace {

std::string n(int64_t v) { return std::to_string(v); }

[[noreturn]] void refuse(const std::string& key, const std::string& value, const std::string& reason) {
  throw LayoutError(key, value, reason);
}

}  // namespace

LayoutError::LayoutError(std::string key, std::string value, std::string reason)
    : std::invalid_argument(key + " = " + value + ": " + reason),
      key_(std::move(key)),
      value_(std::move(value)),
      reason_(std::move(reason)) {}

const config::Names<PipelineSchedule>& pipeline_schedule_names() {
  static const config::Names<PipelineSchedule> names = {{PipelineSchedule::kGpipe, "gpipe"},
                                                        {PipelineSchedule::kOneFOneB, "1f1b"},
                                                        {PipelineSchedule::kInterleaved, "interleaved"}};
  return names;
}

const std::string& schedule_name(PipelineSchedule schedule) { return config::name_of(pipeline_schedule_names(), schedule); }

const config::Names<ContextParallelImpl>& context_parallel_names() {
  static const config::Names<ContextParallelImpl> names = {{ContextParallelImpl::kRing, "ring"},
                                                           {ContextParallelImpl::kAllToAll, "all_to_all"},
                                                           {ContextParallelImpl::kHybrid, "hybrid"}};
  return names;
}

void ParallelDims::resolve(int64_t world_size) {
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"pp", pp}, {"tp", tp}, {"ep", ep}, {"cp", cp}}) {
    if (value < 1) refuse(key, n(value), "must be >= 1");
  }
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"dp", dp}, {"fsdp", fsdp}}) {
    if (value < 0) refuse(key, n(value), "must be >= 0 (0: the ranks the other axes leave)");
  }
  if (zero_stage < 0 || zero_stage > 3) refuse("zero_stage", n(zero_stage), "must be 0, 1, 2 or 3");
  if (zero_stage == 0 && fsdp > 1) {
    refuse("fsdp", n(fsdp), "shards need zero_stage >= 1 (zero_stage 0 is plain data parallel)");
  }
  if (cp == 1 && cp_a2a == 0) cp_impl = ContextParallelImpl::kRing;  // how attention crosses ranks means nothing at cp 1
  const int64_t model_ranks = pp * ep * cp * tp;
  const std::string model_formula =
      "pp(" + n(pp) + ") * ep(" + n(ep) + ")" + (cp > 1 ? " * cp(" + n(cp) + ")" : "") + " * tp(" + n(tp) + ")";
  if (world_size % model_ranks != 0) {
    const bool by_tp = world_size % tp != 0, by_pp = !by_tp && world_size % (pp * tp) != 0;
    const bool by_cp = !by_tp && !by_pp && world_size % (pp * cp * tp) != 0;
    refuse(by_tp ? "tp" : by_pp ? "pp" : by_cp ? "cp" : "ep", n(by_tp ? tp : by_pp ? pp : by_cp ? cp : ep),
           model_formula + " = " + n(model_ranks) + " does not divide the world size " + n(world_size));
  }
  const int64_t data = world_size / model_ranks;
  const std::string left = "the " + n(data) + " data ranks (world size " + n(world_size) + " / (" + model_formula + "))";
  if (zero_stage == 0) fsdp = 1;
  if (dp == 0 && fsdp == 0) fsdp = data;
  for (auto [key, given, other] : {std::tuple<const char*, int64_t*, int64_t*>{"fsdp", &fsdp, &dp}, {"dp", &dp, &fsdp}}) {
    if (*other != 0 || *given == 0) continue;
    if (data % *given != 0) refuse(key, n(*given), key + std::string("(") + n(*given) + ") does not divide " + left);
    *other = data / *given;
  }
  if (dp * fsdp != data) {
    refuse("dp", n(dp), "dp(" + n(dp) + ") * fsdp(" + n(fsdp) + ") = " + n(dp * fsdp) + " != " + left);
  }
  check();
}

void ParallelDims::check() const {
  for (const auto& [key, value] :
       {std::pair<const char*, int64_t>{"pp", pp}, {"dp", dp}, {"fsdp", fsdp}, {"ep", ep}, {"cp", cp}, {"tp", tp}}) {
    if (value < 1) refuse(key, n(value), "must be >= 1");
  }
  if (cp_a2a < 0) refuse("cp_a2a", n(cp_a2a), "must be >= 0 (0: derived)");
  if (cp_a2a > 0 && cp_impl != ContextParallelImpl::kHybrid) {
    refuse("cp_a2a", n(cp_a2a), "is the all-to-all group of cp_impl = \"hybrid\" only");
  }
  if (cp_impl == ContextParallelImpl::kHybrid && cp < 4) {
    refuse("cp_impl", "\"hybrid\"", "needs cp >= 4 (an all-to-all group of 2 or more, and 2 or more groups in the ring); "
                                     "cp is " + n(cp));
  }
  if (cp_a2a > 0 && (cp % cp_a2a != 0 || cp_a2a < 2 || cp_a2a >= cp)) {
    refuse("cp_a2a", n(cp_a2a), "must divide cp(" + n(cp) + ") and lie between 2 and cp / 2");
  }
  if (zero_stage < 0 || zero_stage > 3) refuse("zero_stage", n(zero_stage), "must be 0, 1, 2 or 3");
  if (zero_stage == 0 && fsdp > 1) {
    refuse("fsdp", n(fsdp), "shards need zero_stage >= 1 (zero_stage 0 is plain data parallel)");
  }
  if (sequence_parallel && tp == 1) refuse("sequence_parallel", "true", "needs tp > 1");
  if (pp > 1 && zero_stage == 3) {
    refuse("zero_stage", "3", "does not combine with pp(" + n(pp) + ") > 1 (every micro-batch would gather every "
                              "stage's parameters again); use zero_stage 1 or 2 with pipelines");
  }
  if (virtual_stages < 1) refuse("virtual_stages", n(virtual_stages), "must be >= 1");
  if (virtual_stages > 1 && schedule != PipelineSchedule::kInterleaved) {
    refuse("virtual_stages", n(virtual_stages), "needs pp_schedule = \"interleaved\"");
  }
  if (virtual_stages > 1 && pp < 2) refuse("virtual_stages", n(virtual_stages), "needs pp >= 2");
  if (schedule == PipelineSchedule::kInterleaved && pp > 1 && virtual_stages < 2) {
    refuse("virtual_stages", n(virtual_stages),
           "pp_schedule = \"interleaved\" needs virtual_stages >= 2 (with one stage per rank it is 1f1b)");
  }
}

void ParallelDims::check_model(const ModelDims& m) const {
  auto divides = [&](const char* what, int64_t value, const std::string& why) {
    if (value % tp != 0) {
      refuse("tp", n(tp), "tp(" + n(tp) + ") does not divide " + what + " (" + n(value) + "); " + why);
    }
  };
  divides("the attention heads", m.heads, "attention is split by heads");
  divides("the key/value heads", m.kv_heads, "attention is split by heads");
  divides("the MLP hidden size", m.ffn, "the MLP is split by its hidden units");
  divides("the vocabulary", m.vocab, "the embedding and head are split by vocabulary rows (not padded: padding would "
                                     "change the model)");
  if (sequence_parallel) divides("the context", m.context, "sequence parallel splits every sequence into tp chunks");
  check_context_parallel(m);
  if (ep > 1 && m.experts == 0) {
    refuse("ep", n(ep), "expert parallel needs a mixture-of-experts model (model.moe_experts > 0)");
  }
  if (ep > 1 && m.experts % ep != 0) {
    refuse("ep", n(ep), "ep(" + n(ep) + ") does not divide model.moe_experts (" + n(m.experts) + "); every rank "
                        "holds moe_experts / ep experts");
  }
  if (stages() > m.layers) {
    refuse(virtual_stages > 1 ? "virtual_stages" : "pp", n(virtual_stages > 1 ? virtual_stages : pp),
           "pp(" + n(pp) + ") * virtual_stages(" + n(virtual_stages) + ") = " + n(stages()) + " stages > " +
               n(m.layers) + " layers; every stage needs a block");
  }
}

int64_t ParallelDims::a2a_group(const ModelDims& m) const {
  if (cp_a2a > 0) return cp_a2a;
  for (int64_t a = cp / 2; a >= 2; --a) {
    if (cp % a == 0 && (m.heads / tp) % a == 0 && (m.kv_heads / tp) % a == 0) return a;
  }
  return 1;
}

void ParallelDims::check_context_parallel(const ModelDims& m) const {
  if (cp == 1) return;
  if (m.context % (2 * cp) != 0) {
    refuse("cp", n(cp), "the context (" + n(m.context) + ") must be a multiple of 2 x cp = " + n(2 * cp) +
                            ": the zigzag split cuts every sequence into 2 x cp equal chunks, rank i holding chunks i "
                            "and 2 x cp - 1 - i");
  }
  if (sequence_parallel && (m.context / cp) % tp != 0) {
    refuse("cp", n(cp), "each rank's context / cp = " + n(m.context / cp) + " rows must be a multiple of tp(" + n(tp) +
                            ") for sequence parallel");
  }
  const int64_t heads = m.heads / tp, kv_heads = m.kv_heads / tp;
  const std::string per_rank = " (heads / tp = " + n(heads) + ", key/value heads / tp = " + n(kv_heads) + ")";
  if (cp_impl == ContextParallelImpl::kAllToAll && (heads % cp != 0 || kv_heads % cp != 0)) {
    refuse("cp_impl", "\"all_to_all\"", "splits each rank's heads over cp(" + n(cp) + "): both head counts" + per_rank +
                                         " must be multiples of cp; use cp_impl = \"ring\" or \"hybrid\"");
  }
  if (cp_impl == ContextParallelImpl::kHybrid) {
    const int64_t a = a2a_group(m);
    if (a < 2 || heads % a != 0 || kv_heads % a != 0) {
      refuse(cp_a2a > 0 ? "cp_a2a" : "cp_impl", cp_a2a > 0 ? n(cp_a2a) : "\"hybrid\"",
             "the all-to-all group (cp_a2a) must divide both head counts" + per_rank + " and cp(" + n(cp) +
                 "), with 2 <= cp_a2a < cp" + (cp_a2a > 0 ? "" : "; no such divisor exists"));
    }
  }
}

void ParallelDims::check_microbatches(int64_t microbatches) const {
  if (microbatches < 1) refuse("microbatches", n(microbatches), "needs at least one micro-batch per data rank");
  if (schedule == PipelineSchedule::kInterleaved && pp > 1 && microbatches % pp != 0) {
    refuse("microbatches", n(microbatches),
           "the interleaved schedule needs micro-batches per step divisible by pp(" + n(pp) + ")");
  }
}

MeshLayout ParallelDims::mesh_layout() const {
  return MeshLayout::from_degrees({{"pp", static_cast<int>(pp)},
                                   {"dp", static_cast<int>(dp)},
                                   {"fsdp", static_cast<int>(fsdp)},
                                   {"ep", static_cast<int>(ep)},
                                   {"cp", static_cast<int>(cp)},
                                   {"tp", static_cast<int>(tp)}},
                                  static_cast<int>(world()));
}

std::string ParallelDims::formula() const {
  return "pp(" + n(pp) + ") * dp(" + n(dp) + ") * fsdp(" + n(fsdp) + ") * ep(" + n(ep) + ")" +
         (cp > 1 ? " * cp(" + n(cp) + ")" : "") + " * tp(" + n(tp) + ")";
}

std::string ParallelDims::str() const {
  std::string text = "pp=" + n(pp);
  if (pp > 1) text += " " + schedule_name(schedule) + (virtual_stages > 1 ? " v=" + n(virtual_stages) : "");
  text += " dp=" + n(dp) + " fsdp=" + n(fsdp);
  if (ep > 1) text += " ep=" + n(ep);
  if (cp > 1) {
    text += " cp=" + n(cp) + " " + config::name_of(context_parallel_names(), cp_impl);
    if (cp_a2a > 0) text += " a2a=" + n(cp_a2a);
  }
  text += " tp=" + n(tp) + (sequence_parallel ? " sp" : "") + " zero=" + n(zero_stage);
  return text;
}

bool ParallelDims::operator==(const ParallelDims& o) const {
  return pp == o.pp && dp == o.dp && fsdp == o.fsdp && ep == o.ep && cp == o.cp && cp_impl == o.cp_impl &&
         cp_a2a == o.cp_a2a && tp == o.tp &&
         sequence_parallel == o.sequence_parallel && zero_stage == o.zero_stage && schedule == o.schedule &&
         virtual_stages == o.virtual_stages;
}

}  // namespace meshtrain::mesh
