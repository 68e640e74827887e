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

void ParallelDims::resolve(int64_t world_size) {
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"pp", pp}, {"tp", tp}, {"ep", ep}}) {
    if (value < 1) refuse(key, n(value), "must be >= 1");
  }
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"dp", dp}, {"fsdp", fsdp}}) {
    if (value < 0) refuse(key, n(value), "must be >= 0 (0: the ranks the other axes leave)");
  }
  if (zero_stage < 0 || zero_stage > 3) refuse("zero_stage", n(zero_stage), "must be 0, 1, 2 or 3");
  if (zero_stage == 0 && fsdp > 1) {
    refuse("fsdp", n(fsdp), "shards need zero_stage >= 1 (zero_stage 0 is plain data parallel)");
  }
  const int64_t model_ranks = pp * ep * tp;
  const std::string model_formula = "pp(" + n(pp) + ") * ep(" + n(ep) + ") * tp(" + n(tp) + ")";
  if (world_size % model_ranks != 0) {
    refuse(world_size % tp != 0 ? "tp" : world_size % (pp * tp) != 0 ? "pp" : "ep",
           n(world_size % tp != 0 ? tp : world_size % (pp * tp) != 0 ? pp : ep),
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
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"pp", pp}, {"dp", dp}, {"fsdp", fsdp}, {"ep", ep}, {"tp", tp}}) {
    if (value < 1) refuse(key, n(value), "must be >= 1");
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
                                   {"tp", static_cast<int>(tp)}},
                                  static_cast<int>(world()));
}

std::string ParallelDims::formula() const {
  return "pp(" + n(pp) + ") * dp(" + n(dp) + ") * fsdp(" + n(fsdp) + ") * ep(" + n(ep) + ") * tp(" + n(tp) + ")";
}

std::string ParallelDims::str() const {
  std::string text = "pp=" + n(pp);
  if (pp > 1) text += " " + schedule_name(schedule) + (virtual_stages > 1 ? " v=" + n(virtual_stages) : "");
  text += " dp=" + n(dp) + " fsdp=" + n(fsdp);
  if (ep > 1) text += " ep=" + n(ep);
  text += " tp=" + n(tp) + (sequence_parallel ? " sp" : "") + " zero=" + n(zero_stage);
  return text;
}

bool ParallelDims::operator==(const ParallelDims& o) const {
  return pp == o.pp && dp == o.dp && fsdp == o.fsdp && ep == o.ep && tp == o.tp &&
         sequence_parallel == o.sequence_parallel && zero_stage == o.zero_stage && schedule == o.schedule &&
         virtual_stages == o.virtual_stages;
}

}  // namespace meshtrain::mesh
