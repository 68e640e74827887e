#include "meshtrain/train/verify.h"

#include "meshtrain/model/config_json.h"
#include "meshtrain/train/block_outputs.h"
#include "meshtrain/train/one_process.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/config_keys.h"
#include "meshtrain/util/files.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

namespace meshtrain::train {

namespace {

using Parameters = std::map<std::string, at::Tensor>;

// Per-step copies of the parameters are kept up to this many bytes (both runs' together).
constexpr double kEachStepBytes = 1024.0 * 1024 * 1024;

bool has_bfloat16(const TrainConfig& c) {
  return c.bfloat16() || c.parallel.param_dtype == at::kBFloat16 || c.parallel.reduce_dtype == at::kBFloat16 ||
         (c.lora.enabled() && c.lora.base_dtype == at::kBFloat16);
}

// Where a parameter sits in model order: the embeddings (-1), block N, then the final norm and head (layers).
int64_t block_of(const std::string& name, int64_t layers) {
  if (name.rfind("blocks.", 0) == 0) return std::stoll(name.substr(7, name.find('.', 7) - 7));
  if (name.rfind("wte", 0) == 0 || name.rfind("wpe", 0) == 0) return -1;
  return layers;
}

std::string block_name(int64_t block, int64_t layers) {
  if (block < 0) return "the embeddings";
  if (block >= layers) return "the final norm and head";
  return "blocks." + std::to_string(block);
}

// The parameters' differences: relative over the model, the largest element, and the first block (model
// order) holding a parameter whose largest difference passes `tolerance`.
void compare(const Parameters& got, const Parameters& want, double tolerance, int64_t layers, VerifyStep& step) {
  double diff_sq = 0, want_sq = 0;
  int64_t first = layers + 1;
  for (const auto& [name, expected] : want) {
    auto it = got.find(name);
    if (it == got.end()) throw std::runtime_error("verify: the layout's parameters have no " + name);
    const at::Tensor want_values = expected.to(at::kDouble), d = it->second.to(at::kDouble) - want_values;
    diff_sq += d.pow(2).sum().item<double>();
    want_sq += want_values.pow(2).sum().item<double>();
    const double largest = d.numel() ? d.abs().max().item<double>() : 0.0;
    step.parameter_largest = std::max(step.parameter_largest, largest);
    const int64_t block = block_of(name, layers);
    if (largest > tolerance && (block < first || (block == first && largest > step.first_parameter_difference))) {
      first = block;
      step.first_parameter = name;
      step.first_parameter_difference = largest;
    }
  }
  step.parameters_compared = true;
  step.parameter_relative = std::sqrt(diff_sq) / std::max(std::sqrt(want_sq), 1e-12);
  if (first <= layers) step.first_block = block_name(first, layers);
}

// Each block's output against one process's: the largest difference, the first beyond `tolerance`.
void compare_outputs(const std::vector<BlockOutput>& got, const std::vector<BlockOutput>& want, double tolerance,
                     int64_t layers, VerifyStep& step) {
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double d = block_output_difference(got[i], want[i]);
    const std::string name = block_name(static_cast<int64_t>(i), layers);
    if (d > step.output_largest || step.output_largest_block.empty()) step.output_largest = d, step.output_largest_block = name;
    if (d > tolerance && step.first_output_block.empty()) step.first_output_block = name, step.first_output_difference = d;
  }
}

double relative(double got, double want) { return std::abs(got - want) / std::max(std::abs(want), 1e-12); }

// What passes a tolerance at `step`, in words ("" when nothing does).
std::string difference_at(const VerifyStep& s, const VerifyReport& r) {
  char text[256];
  if (s.loss_difference > r.loss_tolerance) {
    std::snprintf(text, sizeof text, "the loss differs by %.1e (relative; tolerance %.0e)", s.loss_difference,
                  r.loss_tolerance);
    return text;
  }
  if (s.grad_difference > r.grad_tolerance) {
    std::snprintf(text, sizeof text, "the gradient norm differs by %.1e (relative; tolerance %.0e)", s.grad_difference,
                  r.grad_tolerance);
    return text;
  }
  if (s.parameters_compared && (s.parameter_relative > r.parameter_tolerance || !s.first_block.empty())) {
    std::snprintf(text, sizeof text, "the parameters differ by %.1e (relative) and %.1e (largest element; tolerance %.0e)",
                  s.parameter_relative, s.parameter_largest, r.parameter_tolerance);
    return text;
  }
  return "";
}

}  // namespace

std::string scale_down(TrainConfig& c, int world_size) {
  const TrainConfig before = c;
  model::GptConfig m = c.model;
  m.head_size = 0;
  m.width = m.heads * 16;
  m.ffn_hidden = 0;
  m.moe_hidden = 0;
  if (m.moe_shared_hidden > 0) m.moe_shared_hidden = 32;
  if (m.query_scale == static_cast<double>(before.model.head_dim())) m.query_scale = 0;  // the head size, still
  const int64_t fixed_microbatches = c.parallel.microbatches;
  const int64_t data_ranks = c.parallel.dims.data_ranks();
  for (int64_t context : {64, 128, 32, 256, 16}) {
    if (context > before.model.context) continue;
    for (int64_t layers = std::min<int64_t>(2, m.layers); layers <= std::min<int64_t>(m.layers, 64); ++layers) {
      for (int64_t k = std::max<int64_t>(1, c.parallel.dims.pp); k <= 64; ++k) {  // a pipeline gets pp micro-batches
        TrainConfig t = c;
        t.model = m;
        t.model.context = context;
        t.model.layers = layers;
        if (t.model.sliding_window > 0) t.model.sliding_window = std::max<int64_t>(1, std::min(m.sliding_window, context / 2));
        if (t.model.rope_original_context > 0) t.model.rope_original_context = std::min(m.rope_original_context, context);
        t.micro_batch = 1;
        t.batch = k * data_ranks * std::max<int64_t>(fixed_microbatches, 1);
        try {
          t.validate(world_size);
        } catch (const std::invalid_argument&) {
          continue;
        }
        c = t;
        auto change = [](const char* what, int64_t from, int64_t to) {
          return from == to ? std::string() : std::string(", ") + what + " " + std::to_string(from) + " -> " + std::to_string(to);
        };
        const std::string text = change("layers", before.model.layers, c.model.layers) +
                                 change("width", before.model.width, c.model.width) +
                                 change("context", before.model.context, c.model.context) +
                                 change("batch", before.batch, c.batch) +
                                 change("micro-batch", before.micro_batch, c.micro_batch);
        return text.empty() ? "nothing to shrink" : text.substr(2);
      }
    }
  }
  throw config::ConfigError("verify --scale-down: no smaller model (16 dims per head, context 16 to 256) fits the layout " +
                            before.parallel.str() + " on " + std::to_string(world_size) + " ranks; verify it without --scale-down");
}

TrainConfig one_process_config(const TrainConfig& layout) {
  TrainConfig single = layout;
  single.parallel = parallel::ParallelSpec{};
  single.micro_batch = layout.micro_batch;  // the layout's, as validated: the same micro-batches, one after another
  single.validate(1);
  return single;
}

VerifyReport verify(const std::shared_ptr<comm::Communicator>& world, TrainConfig c, const VerifyOptions& options) {
  VerifyReport report;
  if (options.steps < 1) throw config::ConfigError("verify --steps must be at least 1");
  if (options.scale_down) report.scaled = scale_down(c, world->size());
  const std::string scratch = util::join_path(c.out, "verify");
  c.out = scratch;
  c.checkpoint_dir = util::join_path(scratch, "checkpoints");
  c.checkpoint_local = false;
  c.resume = false;
  c.steps = options.steps;
  c.sample_tokens = 0;
  c.trace_step = 0;
  c.sharding_report.clear();
  c.validate(world->size());
  report.layout = c.parallel.str(c.micro_batch);
  if (report.layout.empty()) report.layout = "one rank of data parallel";
  report.model = model::fingerprint(c.model);
  const bool bf16 = has_bfloat16(c);
  report.loss_tolerance = options.tolerance > 0 ? options.tolerance : bf16 ? 2e-2 : 1e-5;
  report.grad_tolerance = options.tolerance > 0 ? options.tolerance : bf16 ? 2e-2 : 1e-4;
  report.parameter_tolerance = options.tolerance > 0 ? options.tolerance : bf16 ? 2e-2 : 1e-4;
  const TrainConfig single = one_process_config(c);
  if (world->rank() == 0) util::remove_tree(scratch);  // an earlier verify's
  wait_polling(world->barrier());

  const double bytes = 2.0 * 4.0 * static_cast<double>(c.model.parameter_count()) * options.steps;
  OneProcessOptions o;
  o.steps = options.steps;
  o.each_step = bytes <= kEachStepBytes;
  o.send_to_every_rank = false;  // rank 0 compares
  o.block_outputs = true;
  const OneProcessRun one = one_process(world, single, o);
  {
    Trainer layout(c, world);
    const std::shared_ptr<BlockOutputs> outputs = record_block_outputs(layout.model());
    for (int s = 0; s < options.steps; ++s) {
      outputs->clear();
      const StepResult r = layout.step();
      const std::vector<BlockOutput> computed = outputs->totals(world);
      const bool last = s + 1 == options.steps;
      Parameters parameters;
      if (o.each_step || last) parameters = layout.full_parameters(0);
      if (world->rank() != 0) continue;
      VerifyStep step;
      step.step = s + 1;
      step.loss = r.loss;
      step.grad_norm = r.grad_norm;
      step.one_loss = one.steps.at(s).loss;
      step.one_grad_norm = one.steps.at(s).grad_norm;
      step.loss_difference = relative(step.loss, step.one_loss);
      step.grad_difference = relative(step.grad_norm, step.one_grad_norm);
      if (o.each_step || last) {
        compare(parameters, o.each_step ? one.each_step.at(s) : one.parameters, report.parameter_tolerance,
                c.model.layers, step);
      }
      compare_outputs(computed, one.block_outputs.at(s), report.parameter_tolerance, c.model.layers, step);
      report.steps.push_back(step);
      if (report.first_different == 0) {
        report.difference = difference_at(step, report);
        if (!report.difference.empty()) report.first_different = step.step;
      }
    }
  }
  wait_polling(world->barrier());
  if (world->rank() == 0) util::remove_tree(scratch);
  return report;
}

}  // namespace meshtrain::train
