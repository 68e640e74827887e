// meshtrain plan: will it fit, and which layout is fastest? See plan/.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"
#include "meshtrain/apps/plan_auto.h"
#include "meshtrain/comm/agree.h"
#include "meshtrain/interop/hf_checkpoint.h"
#include "meshtrain/plan/from_config.h"
#include "meshtrain/plan/machines.h"
#include "meshtrain/plan/search.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/files.h"
#include "meshtrain/util/memory.h"
#include "meshtrain/util/cores.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <algorithm>
#include <optional>
#include <thread>
#include <unistd.h>

namespace meshtrain::apps {

namespace {

using Clock = std::chrono::steady_clock;

bool is_config_file(const std::string& model) {
  return model.size() > 5 && model.compare(model.size() - 5, 5, ".toml") == 0;
}

// A rank's matmul rate on this host's CPU: one 1024 product per thread of this process, scaled to every core.
double cpu_flops_all_cores() {
  const memory::HostScope uncounted;
  const int64_t n = 1024;
  at::Tensor a = at::linspace(-1, 1, n * n).view({n, n}), b = a.t().contiguous(), c = at::empty({n, n});
  at::mm(a.narrow(0, 0, 256), b);  // warm-up
  double best = 1e30;
  for (int i = 0; i < 2; ++i) {
    const auto start = Clock::now();
    at::mm_out(c, a, b);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  const double cores = util::process_cores();
  return 2.0 * n * n * n / best / at::get_num_threads() * cores;
}

// --moe-load: a number, or a training run's metrics.jsonl whose steps report
// per MoE layer rank_load_by_ep (the load at every expert parallel degree),
// or, from runs before it, rank_load and the share dropped at capacity. Each
// is the mean over layers (every layer's all-to-alls wait for its busiest
// rank), then the median over the steps after the first. `kept`: 1 - dropped
// (0 for a number).
struct MoeLoad {
  double load = 0, kept = 0;
  std::vector<std::pair<int64_t, double>> by_ep;
};

double median_after_first(std::vector<double> v) {  // the first step's router is the least trained
  if (v.size() > 1) v.erase(v.begin());
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

MoeLoad moe_load_of(const std::string& value) {
  if (value.empty()) return {};
  std::error_code error;
  if (!std::filesystem::is_regular_file(value, error)) {
    size_t used = 0;
    double load = -1;
    try {
      load = std::stod(value, &used);
    } catch (const std::exception&) {
    }
    if (used != value.size() || !(load >= 0) || load > 1e6) {
      throw std::invalid_argument("--moe-load " + value + ": give a load (e.g. 1.2) or a training run's metrics.jsonl");
    }
    return {load, 0, {}};
  }
  std::vector<double> loads, kept;
  std::map<int64_t, std::vector<double>> by_ep;  // per degree, each step's mean over layers
  std::ifstream in(value);
  bool without_ep = false;
  auto number = [](const nlohmann::json& layer, const char* key, double lo, double hi) {
    const auto it = layer.find(key);
    return it != layer.end() && it->is_number() && it->get<double>() >= lo && it->get<double>() <= hi;
  };
  for (std::string text; std::getline(in, text);) {
    const nlohmann::json line = nlohmann::json::parse(text, nullptr, false);
    if (!line.is_object() || !line.contains("step") || !line.contains("moe") || !line["moe"].is_array()) continue;
    double load = 0, dropped = 0, layers = 0;
    std::map<int64_t, std::pair<double, double>> step_by_ep;  // degree -> (sum over layers, layers)
    for (const nlohmann::json& layer : line["moe"]) {
      if (!layer.is_object()) continue;
      if (const auto it = layer.find("rank_load_by_ep"); it != layer.end() && it->is_object()) {
        for (const auto& [degree, value] : it->items()) {
          size_t used = 0;
          int64_t ep = 0;
          try {
            ep = std::stoll(degree, &used);
          } catch (const std::exception&) {
          }
          // A degree in digits and a load; 0 is a layer that routed nothing that step.
          if (used != degree.size() || ep < 1 || !value.is_number() || !(value.get<double>() > 0) ||
              value.get<double>() > 1e6) {
            continue;
          }
          step_by_ep[ep].first += value.get<double>(), step_by_ep[ep].second += 1;
        }
      }
      if (!number(layer, "rank_load", 0, 1e6)) continue;
      if (layer.contains("ep") && !number(layer, "ep", 2, 1e9)) {
        without_ep = true;  // a rank without expert parallel: its own assignments, not the busiest rank's
        continue;
      }
      load += layer["rank_load"].get<double>(), ++layers;
      if (number(layer, "dropped", 0, 1)) dropped += layer["dropped"].get<double>();
    }
    for (const auto& [ep, sum] : step_by_ep) by_ep[ep].push_back(sum.first / sum.second);
    if (layers > 0 && load > 0) loads.push_back(load / layers), kept.push_back(1 - dropped / layers);
  }
  MoeLoad out;
  for (const auto& [ep, series] : by_ep) out.by_ep.emplace_back(ep, median_after_first(series));
  if (!out.by_ep.empty()) return out;
  if (loads.empty() && without_ep) {
    throw std::invalid_argument("--moe-load " + value + ": its run had no expert parallel (ep = 1) and reports no "
                                "rank_load_by_ep, so its rank_load is what a rank keeps of its own assignments; train "
                                "with this version for a few steps and pass that run's metrics.jsonl");
  }
  if (loads.empty()) {
    throw std::invalid_argument("--moe-load " + value + ": no step in it reports the MoE layers' load; train the "
                                "MoE model for a few steps and pass its metrics.jsonl");
  }
  out.load = median_after_first(loads);
  out.kept = std::clamp(median_after_first(kept), 1e-3, 1.0);
  return out;
}

// The profile a plan is for (Note [This machine]): "this" (the default), a preset or a file; then the flags over it.
// `said` gets what the header adds after the figures.
plan::Machine machine_of(const PlanOptions& o, std::string& said) {
  plan::Machine m;
  const std::string how_to = "`meshtrain run -n 2 plan --calibrate --save machine.json` measures them";
  if (o.machine == "this") {
    if (const auto gpus = plan::detect_gpus()) {
      m = gpus->machine;
      said = "this machine" + (gpus->assumed.empty() ? "" : "; " + gpus->assumed) + "; bandwidths assumed: " + how_to;
    } else {
      const int64_t ranks = o.gpus_per_node > 0 ? std::min(o.gpus_per_node, o.world) : o.world;
      const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
      const int64_t cores = util::process_cores();
      m = plan::cpu_machine(memory, o.peak_tflops > 0 ? 0 : cpu_flops_all_cores(), ranks,
                            plan::cpu_model_name() + " (" + std::to_string(cores) + " cores)", cores);
      said = "this machine's CPU, its memory and cores shared by " + std::to_string(ranks) +
             " ranks; peak measured, MFU and bandwidths assumed: " + how_to + "; --machine h100 plans for GPUs";
    }
  } else if (std::filesystem::is_regular_file(o.machine)) {
    m = plan::Machine::from_json(util::read_text_file(o.machine));
  } else if (o.machine.find_first_of("./") != std::string::npos) {
    throw UsageError("--machine " + o.machine + ": no such file (a profile from --calibrate --save, or this, " +
                     "h100, h200, a100)");
  } else {
    m = plan::machine_preset(o.machine);
    said = "the " + o.machine + " profile";
  }
  if (!o.device_memory.empty()) {
    // "80" was 80 bytes, and nothing fit: a device's memory takes a unit.
    if (o.device_memory.find_first_not_of("0123456789.") == std::string::npos) {
      throw UsageError("--device-memory " + o.device_memory + ": give a unit, e.g. " + o.device_memory + "GiB (or " +
                       o.device_memory + "GB, decimal)");
    }
    m.device_memory = plan::parse_bytes(o.device_memory);
  }
  if (o.gpus_per_node > 0) m.devices_per_node = o.gpus_per_node;
  if (o.peak_tflops > 0) m.peak_flops = o.peak_tflops * 1e12;
  if (o.mfu > 0) m.mfu = o.mfu;
  if (o.intra_gbps > 0) m.intra_bandwidth = o.intra_gbps * 1e9;
  if (o.inter_gbps > 0) m.inter_bandwidth = o.inter_gbps * 1e9;
  if (o.latency_us > 0) m.latency = o.latency_us * 1e-6;
  if (m.mfu > 1) throw std::invalid_argument("--mfu must be at most 1 (a share of the peak)");
  return m;
}

std::string gib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", bytes / 1073741824.0);
  return text;
}

nlohmann::json memory_json(const plan::MemoryBreakdown& m) {
  return {{"parameters", m.parameters}, {"gradients", m.gradients}, {"optimizer", m.optimizer},
          {"activations", m.activations}, {"outputs", m.outputs},   {"buffers", m.buffers},
          {"workspace", m.workspace},   {"host", m.host},           {"total", m.total()},
          {"peak_at", m.moment}};
}

nlohmann::json candidate_json(const plan::Candidate& c) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : c.ranks) {
    ranks.push_back({{"pipeline_rank", r.pipeline_rank}, {"layers", r.layers}, {"moe_layers", r.moe_layers},
                     {"in_flight", r.in_flight}, {"parameters", r.parameter_count},
                     {"expert_parameters", r.expert_parameter_count}, {"memory_bytes", memory_json(r.memory)}});
  }
  nlohmann::json traffic = nlohmann::json::array();
  for (const auto& t : c.time.traffic) traffic.push_back({{"group", t.group}, {"what", t.what}, {"bytes", t.bytes}, {"seconds", t.seconds}});
  const plan::TimeBreakdown& t = c.time;
  nlohmann::json j = {{"layout", c.layout.str()},
                      {"microbatches", c.microbatches},
                      {"fits", c.fits},
                      {"peak_bytes", c.worst.memory.total()},
                      {"ranks", ranks},
                      {"time_seconds", {{"step", t.step()}, {"compute", t.compute}, {"recompute", t.recompute},
                                        {"bubble", t.bubble}, {"tensor_parallel", t.tensor_parallel},
                                        {"data_parallel", t.data_parallel}, {"pipeline", t.pipeline},
                                        {"expert_parallel", t.expert_parallel},
                                        {"context_parallel", t.context_parallel}, {"offload", t.offload},
                                        {"optimizer", t.optimizer}}},
                      {"tokens_per_second", t.tokens_per_second},
                      {"mfu", t.mfu},
                      {"traffic", traffic}};
  if (!c.fits) j["why_not"] = c.why_not;
  return j;
}

// The flags that change the model's context and the workload: --seq, --precision, --attention, --selective,
// --loss, --global-batch, --moe-load.
void apply_workload_flags(const PlanOptions& o, model::GptConfig& model, plan::Workload& workload) {
  if (o.seq > 0) model.context = o.seq;
  if (!o.precision.empty()) workload.precision = plan::Precision::parse(o.precision);
  if (!o.attention.empty()) {
    if (o.attention != "flash" && o.attention != "math" && o.attention != "batched") {
      throw std::invalid_argument("--attention: use flash, math or batched");
    }
    workload.attention = o.attention;
  }
  if (o.selective == "ops") {
    if (!o.auto_path.empty()) {
      throw std::invalid_argument("--selective ops models op-level recompute, which train does not run; --auto writes what "
                                  "train runs: leave --selective at core");
    }
    workload.selective = plan::SelectivePolicy::kOps;
  }
  // --auto writes a config train runs, and train's bfloat16 is autocast.
  if (!o.auto_path.empty() && workload.precision.name == "bf16-mixed") workload.precision = plan::Precision::parse("bf16-autocast");
  if (o.loss == "loss-parallel" && !o.auto_path.empty()) {
    throw std::invalid_argument("--loss loss-parallel models PyTorch's loss_parallel, which train does not run; --auto "
                                "writes what train runs: give --loss chunked or whole");
  }
  if (!o.loss.empty()) workload.chunked_loss = model.chunked_loss = o.loss == "chunked";
  workload.torch_loss_parallel = o.loss == "loss-parallel";
  if (o.pipeline_fsdp == "torch" && !o.auto_path.empty()) {
    throw std::invalid_argument("--pipeline-fsdp torch models FSDP2 under torch's pipelining, which train does not run; "
                                "--auto writes what train runs: leave --pipeline-fsdp out");
  }
  workload.torch_pipeline_fsdp = o.pipeline_fsdp == "torch";
  if (o.global_batch > 0) workload.global_batch = o.global_batch;
  const MoeLoad moe = moe_load_of(o.moe_load);
  if (moe.load > 0) workload.moe_load = moe.load, workload.moe_kept = moe.kept;
  // The largest degree a run reports is its expert count: another model's loads would not apply.
  if (!moe.by_ep.empty() && moe.by_ep.back().first != model.moe_experts) {
    throw std::invalid_argument("--moe-load " + o.moe_load + ": its run had " + std::to_string(moe.by_ep.back().first) +
                                " experts per layer and this model has " + std::to_string(model.moe_experts) +
                                "; train this model for a few steps and pass that run's metrics.jsonl");
  }
  workload.moe_load_by_ep = moe.by_ep;
}

// `said`: what the profile is (this machine, a preset), and which of its figures are assumed.
void print_header(const model::GptConfig& model, const std::string& name, const plan::Workload& w, const plan::Machine& m,
                  int64_t world, const std::string& said) {
  std::printf("model    %s\n", model.describe(name).c_str());
  std::printf("run      %lld ranks (%lld per node), %s per device, %s, global batch %lld x %lld tokens, %s attention, %s "
              "loss%s\n",
              (long long)world, (long long)m.devices_per_node, plan::format_bytes(m.device_memory).c_str(),
              w.precision.name.c_str(), (long long)w.global_batch, (long long)model.context, w.attention.c_str(),
              w.chunked_loss ? "chunked" : w.torch_loss_parallel ? "whole-logits (PyTorch's loss_parallel)" : "whole-logits",
              w.selective == plan::SelectivePolicy::kOps ? ", selective recompute op-level" : "");
  if (w.torch_pipeline_fsdp) std::printf("         ZeRO-2 under a pipeline as FSDP2 under torch's pipelining: gradients whole, fp32\n");
  if (model.moe() && !w.moe_load_by_ep.empty()) {
    std::printf("experts  the busiest rank computes x tokens x top_k per layer, by expert parallel degree:");
    for (const auto& [ep, load] : w.moe_load_by_ep) std::printf(" %lld: %.2f", (long long)ep, load);
    std::printf(" (--moe-load)\n");
  } else if (model.moe() && w.moe_load > 0) {
    std::printf("experts  the busiest rank under expert parallel computes %.2f x tokens x top_k per layer", w.moe_load);
    if (w.moe_kept > 0) std::printf(", a rank without it %.2f (the rest dropped at capacity)", w.moe_kept);
    std::printf(" (--moe-load)\n");
  }
  std::printf("machine  %s: %.3g TFLOP/s peak x MFU %.2f, %.3g GB/s in a node, %.3g GB/s across, %.0f us latency%s\n",
              m.name.c_str(), m.peak_flops / 1e12, m.mfu, m.intra_bandwidth / 1e9, m.inter_bandwidth / 1e9, m.latency * 1e6,
              said.empty() ? "" : (" (" + said + ")").c_str());
  const plan::OperatorRates& r = m.operators;
  if (!r.measured()) return;
  if (!r.measured_for(w.precision.activation)) {
    std::printf("operators measured in %s, not %s: the step is its FLOPs at peak x MFU\n", r.precision.c_str(),
                w.precision.name.c_str());
    return;
  }
  std::printf("operators products %.3g GFLOP/s + %.1f us, attention %.3g GFLOP/s + %.1f us, elementwise %.3g GB/s + %.1f "
              "us, x %.2f overhead (Note [Operator time])\n",
              r.matmul_flops / 1e9, r.matmul_call * 1e6, r.attention_flops / 1e9, r.attention_call * 1e6,
              r.elementwise_bytes / 1e9, r.elementwise_call * 1e6, r.overhead);
}

void print_table_head() {
  std::printf("\n %3s  %-46s %7s %7s %7s %7s %7s %8s  %8s %10s %5s\n", "#", "layout", "params", "grads", "optim",
              "activ", "other", "peak GiB", "step s", "tokens/s", "MFU");
}

void print_row(int index, const plan::Candidate& c) {
  const plan::MemoryBreakdown& m = c.worst.memory;
  std::printf(" %3d  %-46s %7s %7s %7s %7s %7s %8s  %8.3f %10.0f %4.0f%%\n", index, c.layout.str().c_str(),
              gib(m.parameters).c_str(), gib(m.gradients).c_str(), gib(m.optimizer).c_str(), gib(m.activations).c_str(),
              gib(m.outputs + m.buffers + m.workspace).c_str(), gib(m.total()).c_str(), c.time.step(),
              c.time.tokens_per_second, 100 * c.time.mfu);
}

// The breakdown of one layout, per pipeline rank and per term, and its time.
void print_detail(const plan::Candidate& c, const plan::Machine& machine) {
  std::printf("\nlayout   %s, %lld micro-batches of %lld per data rank per step\n", c.layout.str().c_str(),
              (long long)c.microbatches, (long long)c.layout.micro_batch);
  std::printf("memory per rank (GiB; 'other' = logits/loss + buffers + work space at the peak):\n");
  std::printf("  %-4s %6s %9s %7s %7s %7s %7s %7s %7s %7s  %s\n", "pp", "layers", "in flight", "params", "grads",
              "optim", "activ", "other", "peak", "host", "peak at");
  for (const auto& r : c.ranks) {
    const plan::MemoryBreakdown& m = r.memory;
    std::printf("  %-4d %6lld %9lld %7s %7s %7s %7s %7s %7s %7s  %s\n", r.pipeline_rank, (long long)r.layers,
                (long long)r.in_flight, gib(m.parameters).c_str(), gib(m.gradients).c_str(), gib(m.optimizer).c_str(),
                gib(m.activations).c_str(), gib(m.outputs + m.buffers + m.workspace).c_str(), gib(m.total()).c_str(),
                gib(m.host).c_str(), m.moment.c_str());
  }
  std::printf("  %s\n", c.fits ? ("fits: " + plan::format_bytes(machine.device_memory - c.worst.memory.total()) +
                                   " to spare on the fullest rank").c_str()
                                : ("does not fit: " + c.why_not).c_str());
  const plan::TimeBreakdown& t = c.time;
  std::printf("time per step %.3f s: compute %.3f (recompute %.3f), bubble %.3f, exposed tp %.3f, dp %.3f, pp %.3f, "
              "ep %.3f, cp %.3f, offload %.3f, optimizer %.3f -> %.0f tokens/s, MFU %.1f%%\n",
              t.step(), t.compute, t.recompute, t.bubble, t.tensor_parallel, t.data_parallel, t.pipeline,
              t.expert_parallel, t.context_parallel, t.offload, t.optimizer, t.tokens_per_second, 100 * t.mfu);
  for (const auto& traffic : t.traffic) {
    std::printf("  %-4s %-44s %10s per step, %.4f s before overlap\n", traffic.group.c_str(), traffic.what.c_str(),
                plan::format_bytes(traffic.bytes).c_str(), traffic.seconds);
  }
}

}  // namespace

int run_plan(const PlanOptions& o) {
  const auto start = Clock::now();
  if (o.world < 1) throw std::invalid_argument("--world must be >= 1");
  if (!o.auto_path.empty() && !o.layout.empty()) throw UsageError("--auto searches every layout; give it without --layout");
  model::GptConfig model;
  std::string name = o.model;
  plan::Workload workload;
  std::optional<plan::PlannedRun> configured;
  std::optional<train::TrainConfig> source;  // the config file's, for --auto
  if (is_config_file(o.model)) {
    train::TrainConfig config = train::TrainConfig::load(o.model, {});
    source = config;
    if (o.layout == "config") {
      config.validate(static_cast<int>(o.world));
      configured = plan::planned_run(config);
    }
    const plan::PlannedRun run = configured ? *configured : plan::planned_model(config);
    model = run.model;
    name = run.name;
    workload = run.workload;
  } else if (std::filesystem::is_directory(o.model)) {
    // A Hugging Face model folder (its config.json), or a meshtrain checkpoint (its latest step).
    model = std::filesystem::exists(std::filesystem::path(o.model) / "config.json")
                ? interop::read_hf_config(o.model).config
                : train::init_model(o.model);
  } else {
    model = plan::preset_model(o.model);
  }
  if (!source) workload.chunked_loss = model.chunked_loss;  // on unless a config turns it off
  if (source && source->parallel.annotated() && o.loss == "chunked") {
    throw std::invalid_argument("--loss chunked: " + o.model + " shards by annotations (parallel.tp_impl = "
                                "\"annotations\"), whose training computes the whole logits; leave --loss out");
  }
  apply_workload_flags(o, model, workload);
  if (workload.global_batch == 0) workload.global_batch = plan::default_global_batch(model, o.world);
  std::string said;
  const plan::Machine machine = machine_of(o, said);
  // The loss's chunk and the operators as on the devices planned for (a config file's follow its run.device).
  if (!source) plan::set_device_operators(workload, model.fused, machine.cores_per_node == 0, false);

  if (!o.layout.empty()) {
    plan::Layout layout = configured ? configured->layout : plan::Layout::parse(o.layout);
    if (layout.world() != o.world) {
      throw std::invalid_argument("layout " + layout.str() + " uses pp x dp x fsdp x ep x cp x tp = " + std::to_string(layout.world()) +
                                  " ranks, not --world " + std::to_string(o.world));
    }
    const plan::Candidate c = plan::evaluate(model, workload, layout, machine);
    if (o.json) {
      std::printf("%s\n", candidate_json(c).dump(2).c_str());
      return 0;
    }
    print_header(model, name, workload, machine, o.world, said);
    print_detail(c, machine);
    return 0;
  }

  const plan::SearchResult result = plan::search(model, workload, machine, o.world);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!o.auto_path.empty()) {
    const bool preset = !source && !std::filesystem::is_directory(o.model);
    std::printf("%s", auto_plan({name, preset, model, workload, machine, result, source}, o.world, o.auto_path).c_str());
    std::printf("meshtrain: wrote %s (searched %lld layouts in %.2f s)\n", o.auto_path.c_str(),
                static_cast<long long>(result.examined), seconds);
    return 0;
  }
  if (o.json) {
    nlohmann::json fitting = nlohmann::json::array(), rejected = nlohmann::json::array();
    for (size_t i = 0; i < result.fitting.size() && i < static_cast<size_t>(o.top); ++i) fitting.push_back(candidate_json(result.fitting[i]));
    for (size_t i = 0; i < result.rejected.size() && i < static_cast<size_t>(o.top); ++i) rejected.push_back(candidate_json(result.rejected[i]));
    nlohmann::json j = {{"model", model.describe(name)},     {"parameters", model.parameter_count()},
                        {"active_parameters", model.active_parameter_count()},
                        {"world", o.world},              {"device_memory", machine.device_memory},
                        {"global_batch", workload.global_batch}, {"examined", result.examined},
                        {"fitting", result.fitting.size()}, {"best", fitting}, {"closest_rejected", rejected}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  print_header(model, name, workload, machine, o.world, said);
  std::printf("searched %lld layouts in %.2f s: %zu fit, %zu do not\n", (long long)result.examined, seconds,
              result.fitting.size(), result.rejected.size());
  if (!result.fitting.empty()) {
    std::printf("\nfastest layouts that fit (per-rank memory of the fullest rank):");
    print_table_head();
    for (size_t i = 0; i < result.fitting.size() && i < static_cast<size_t>(o.top); ++i) print_row(static_cast<int>(i + 1), result.fitting[i]);
    print_detail(result.fitting.front(), machine);
  } else {
    std::printf("\nno layout fits %s per device; give more ranks or memory, or a shorter --seq / smaller model.\n",
                plan::format_bytes(machine.device_memory).c_str());
  }
  if (!result.rejected.empty()) {
    std::printf("\nclosest that do not fit:\n");
    for (size_t i = 0; i < result.rejected.size() && i < 5; ++i) {
      std::printf("  %-46s %s\n", result.rejected[i].layout.str().c_str(), result.rejected[i].why_not.c_str());
    }
  }
  return 0;
}

namespace {

// Plans in one process; with --calibrate measures on the ranks of a job.
class PlanCommand : public Command {
 public:
  explicit PlanCommand(CLI::App& app);
  bool chosen() const override { return sub_->parsed(); }
  bool on_ranks() const override { return calibrate_; }
  int run(comm::Runtime* runtime) override { return runtime ? run_plan_calibrate(*runtime, o_) : run_plan(o_); }

 private:
  CLI::App* sub_;
  PlanOptions o_;
  bool calibrate_ = false;
};

PlanCommand::PlanCommand(CLI::App& app) {
  sub_ = app.add_subcommand(
      "plan", "Will it fit, and which layout is fastest? For this machine unless --machine names others. Predicts per-rank memory (parameters, gradients, optimizer "
              "states, activations, logits, buffers) and step time of every layout of --world ranks (dp, ZeRO 1-3, "
              "tp + sp, pp schedules, ep for MoE models, micro-batch, recompute, offload), drops those over "
              "--device-memory and ranks the rest; --layout explains one. Runs in one process; `meshtrain run -n 2 "
              "plan --calibrate` measures this machine instead.");
  CLI::App* p = sub_;
  std::string presets;
  for (const std::string& name : model::GptConfig::preset_names()) presets += (presets.empty() ? "" : ", ") + name;
  p->add_option("--model", o_.model,
                "A preset (" + presets + "), a meshtrain config file (.toml), a checkpoint (its model), or a "
                "Hugging Face model folder (its config.json)")
      ->capture_default_str();
  p->add_option("--world", o_.world, "Ranks (devices)")->capture_default_str()->check(CLI::PositiveNumber);
  p->add_option("--device-memory", o_.device_memory, "Memory per device, e.g. 80GiB (default: --machine's)");
  p->add_option("--gpus-per-node", o_.gpus_per_node, "Devices per node (tensor parallel stays inside one)");
  p->add_option("--seq,--model.context", o_.seq, "Sequence length (default: the model's)");
  p->add_option("--global-batch,--training.batch", o_.global_batch,
                "Sequences per optimizer step (default: the config's, else ~1M tokens)");
  p->add_option("--layout", o_.layout,
                "Evaluate one layout, e.g. \"tp=2 sp pp=2 1f1b zero=1 fsdp=2 mb=1 recompute=selective\" (keys: dp fsdp "
                "ep tp sp pp schedule v zero mb recompute offload); \"config\": the --model config file's own");
  p->add_option("--precision", o_.precision,
                "bf16-mixed (2+2+12 bytes per parameter, 16-bit activations), fp32 (4+4+8) or bf16-autocast (4+4+8, "
                "16-bit products and their activations, an fp32 residual stream, 16-bit copies of the weights: train's "
                "training.dtype = \"bfloat16\")");
  p->add_option_function<std::string>(
       "--training.dtype", [this](const std::string& dtype) { o_.precision = dtype == "bfloat16" ? "bf16-autocast" : "fp32"; },
       "As train's: bfloat16 (= --precision bf16-autocast) or float32 (= fp32)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  p->add_option("--attention", o_.attention,
                "flash (no s^2 term), math (softmax saved) or batched (the fused CPU attention: q, k, v copies and "
                "softmax)");
  p->add_option("--selective", o_.selective,
                "What recompute=selective keeps: core (train's: the attention core recomputed) or ops (torchtitan's "
                "op-level policy: a block's input, the attention kernel's output and every other matrix product's; "
                "for comparing with runs that use it, train does not run it)")
      ->capture_default_str()
      ->check(CLI::IsMember({"core", "ops"}));
  p->add_option("--loss", o_.loss,
                "chunked (no logits beyond one chunk) or whole (the logits and an fp32 log-softmax, as PyTorch's "
                "cross_entropy keeps them; --auto writes model.chunked_loss = false) or loss-parallel (the whole "
                "logits split over the vocabulary through PyTorch's loss_parallel, as torchtitan trains with tensor "
                "parallel: their fp32 copy and the decomposed log-softmax's intermediates; for comparing with such "
                "runs, train does not run it) (default: the model's)")
      ->check(CLI::IsMember({"chunked", "whole", "loss-parallel"}));
  p->add_option("--pipeline-fsdp", o_.pipeline_fsdp,
                "ZeRO-2 under a pipeline: meshtrain (gradients sharded each micro-batch) or torch (FSDP2 under "
                "torch.distributed.pipelining, as torchtitan runs it: gradient sync off, each parameter's unsharded "
                "gradient accumulated in fp32 from its chunk's first backward to the reduction after the last, the last "
                "stage's outputs kept to the step's end; for comparing with such runs, train does not run it)")
      ->capture_default_str()
      ->check(CLI::IsMember({"meshtrain", "torch"}));
  p->add_option("--moe-load", o_.moe_load,
                "Mixture of experts: assignments the busiest rank computes per layer over tokens x top_k under expert "
                "parallel, or a training run's metrics.jsonl (any layout), which reports it at every expert parallel "
                "degree as rank_load_by_ep (its median step is taken); ep = 1 layouts compute only their own tokens' "
                "assignments (default: a balanced router)");
  p->add_option("--top", o_.top, "Rows of the ranked table")->capture_default_str();
  p->add_flag("--json", o_.json, "Print JSON instead of tables");
  p->add_option("--machine", o_.machine,
                "The devices planned for: this (this machine's GPUs, or its CPU shared by the ranks), h100, h200, a100, "
                "or a profile file (JSON from --calibrate --save)")
      ->capture_default_str();
  p->add_option("--peak-tflops", o_.peak_tflops, "Peak dense TFLOP/s per device (default: --machine's; h100: 989)");
  p->add_option("--mfu", o_.mfu, "Share of the peak a step achieves (default 0.45)");
  p->add_option("--intra-gbps", o_.intra_gbps, "Collective bus bandwidth inside a node, GB/s (default: --machine's; h100: 360)");
  p->add_option("--inter-gbps", o_.inter_gbps, "... across nodes, per device, GB/s (default: --machine's; h100: 45)");
  p->add_option("--latency-us", o_.latency_us, "Latency per collective step, microseconds (default: --machine's; h100: 10)");
  p->add_option("--auto", o_.auto_path,
                "Write the fastest layout that fits to this file as a config train takes as it is (with the "
                "runners-up and why they lost as comments); the --model config file's other keys are kept");
  p->add_flag("--calibrate", calibrate_,
              "Measure this machine: each operator class's rate, a short training run against them, and under "
              "`meshtrain run -n N` the collectives (with --precision bf16-mixed or bf16-autocast: in bf16)");
  p->add_option("--save", o_.save, "With --calibrate: write the profile to this file");
  p->footer("Examples:\n  meshtrain plan --model llama2-7b --world 8 --machine h100\n"
            "  meshtrain plan --model runs/default/checkpoints --world 2\n"
            "  meshtrain plan --model gpt3-175b --world 1024 --layout \"pp=8 1f1b tp=8 sp dp=16 zero=1 mb=1 "
            "recompute=selective\"\n"
            "  meshtrain plan --model my-run.toml --world 4 --auto my-run-4.toml\n"
            "  meshtrain run -n 2 plan --calibrate --save machine.json");
}

}  // namespace

CommandPtr add_plan(CLI::App& app) { return std::make_unique<PlanCommand>(app); }

}  // namespace meshtrain::apps
