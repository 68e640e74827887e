#include "meshtrain/parallel/pipeline/stages.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace meshtrain::parallel::pipeline {

std::string StageSpec::str() const {
  std::string text = embed ? "embed" : "";
  if (end_block > first_block) {
    text += std::string(text.empty() ? "" : "+") + "blocks " + std::to_string(first_block) +
            (end_block - first_block > 1 ? "-" + std::to_string(end_block - 1) : "");
  }
  if (head) text += std::string(text.empty() ? "" : "+") + "head";
  return text;
}

std::vector<double> parameter_costs(const model::GptConfig& c) {
  const double w = double(c.width);
  const double norm = c.bias && c.norm == model::NormStyle::kLayerNorm ? 2 * w : w;
  std::vector<double> costs;
  costs.push_back(double(c.vocab_size) * w + (c.position == model::PositionStyle::kLearned ? double(c.context) * w : 0.0));
  for (int64_t i = 0; i < c.layers; ++i) {
    costs.push_back(double(c.is_moe_block(i) ? c.moe_block_parameters() : c.block_parameters()));
  }
  costs.push_back(norm + double(c.vocab_size) * w);
  return costs;
}

std::vector<double> measured_costs(const model::GptConfig& config, int64_t micro_batch, int repeats) {
  model::Gpt model(config, /*seed=*/1);
  const at::Tensor tokens = at::randint(0, config.vocab_size, {micro_batch, config.context}, at::kLong);
  auto seconds = [&](const std::function<void()>& fn) {
    std::vector<double> times;
    for (int i = 0; i < repeats + 1; ++i) {  // the first run warms up
      const auto start = std::chrono::steady_clock::now();
      fn();
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(times.begin() + 1, times.end());
    return times[1 + repeats / 2];
  };
  at::Tensor hidden;
  const double embed = seconds([&] {
    hidden = model->embed(model::Batch(tokens));
    hidden.sum().backward();
  });
  const at::Tensor input = hidden.detach().requires_grad_(true);
  const double block = seconds([&] { model->block(0, input, model::Batch(tokens)).sum().backward(); });
  const double head = seconds([&] { model->head_loss(input, tokens).backward(); });
  std::vector<double> costs = {embed};
  for (int64_t i = 0; i < config.layers; ++i) costs.push_back(block);
  costs.push_back(head);
  return costs;
}

std::vector<int64_t> balance(const std::vector<double>& costs, int stages) {
  const int64_t layers = static_cast<int64_t>(costs.size()) - 2;
  if (stages < 1 || layers < stages) {
    throw std::invalid_argument("pipeline: " + std::to_string(layers) + " blocks cannot fill " + std::to_string(stages) +
                                " stages (each needs at least one)");
  }
  // prefix[i]: blocks 0..i-1.
  std::vector<double> prefix(layers + 1, 0.0);
  for (int64_t i = 0; i < layers; ++i) prefix[i + 1] = prefix[i] + costs[i + 1];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the lowest maximum over the first k stages holding blocks 0..i-1.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(layers + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(layers + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k) {
    for (int64_t i = k; i <= layers - (stages - k); ++i) {
      for (int64_t j = k - 1; j < i; ++j) {
        double stage = prefix[i] - prefix[j];
        if (k == 1) stage += costs.front();
        if (k == stages) stage += costs.back();
        const double worst = std::max(best[k - 1][j], stage);
        if (worst < best[k][i]) {
          best[k][i] = worst;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> blocks(stages);
  for (int64_t k = stages, i = layers; k >= 1; i = cut[k][i], --k) blocks[k - 1] = i - cut[k][i];
  return blocks;
}

std::vector<int64_t> parse_block_counts(const std::string& text) {
  std::vector<int64_t> blocks;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int64_t n = -1;
    try {
      n = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || n < 1) {
      throw std::invalid_argument("'" + text + "' is not a list of block counts per stage (each >= 1), like \"3,3,2\"");
    }
    blocks.push_back(n);
  }
  return blocks;
}

void check_block_counts(const std::vector<int64_t>& blocks, int64_t layers, int stages) {
  if (static_cast<int>(blocks.size()) != stages) {
    throw std::invalid_argument("gives " + std::to_string(blocks.size()) + " stages, the pipeline has " +
                                std::to_string(stages) + " (pp x virtual_stages)");
  }
  int64_t total = 0;
  for (int64_t n : blocks) total += n;
  if (total != layers) {
    throw std::invalid_argument("places " + std::to_string(total) + " blocks, the model has " + std::to_string(layers));
  }
}

std::vector<int64_t> parse_split(const std::string& text, int64_t layers, int stages) {
  const std::vector<int64_t> blocks = parse_block_counts(text);
  try {
    check_block_counts(blocks, layers, stages);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("'" + text + "' " + e.what());
  }
  return blocks;
}

std::vector<StageSpec> stage_specs(const std::vector<int64_t>& blocks_per_stage) {
  std::vector<StageSpec> specs;
  int64_t next = 0;
  for (size_t s = 0; s < blocks_per_stage.size(); ++s) {
    StageSpec spec;
    spec.first_block = next;
    spec.end_block = next += blocks_per_stage[s];
    spec.embed = s == 0;
    spec.head = s + 1 == blocks_per_stage.size();
    specs.push_back(spec);
  }
  return specs;
}

void keep_stages(model::Gpt& model, const std::vector<StageSpec>& kept) {
  bool embed = false, head = false;
  std::vector<bool> block(model->blocks->size(), false);
  for (const StageSpec& s : kept) {
    embed |= s.embed;
    head |= s.head;
    for (int64_t i = s.first_block; i < s.end_block; ++i) block.at(i) = true;
  }
  torch::NoGradGuard no_grad;
  auto drop = [](torch::nn::Module& parent, const std::string& name) {
    std::shared_ptr<torch::nn::Module> child = parent.named_children()[name];
    for (at::Tensor& t : child->parameters()) t.set_data(at::empty({0}, t.options()));
    for (at::Tensor& t : child->buffers()) t.set_data(at::empty({0}, t.options()));
    parent.unregister_module(name);
  };
  const bool tied = model->config().tie_embeddings;
  if (!embed && !(head && tied)) drop(*model, "wte");
  if (!embed && model->wpe) drop(*model, "wpe");
  if (!head) {
    drop(*model, "norm_f");
    if (model->head) drop(*model, "head");
  }
  for (size_t i = 0; i < block.size(); ++i) {
    if (!block[i]) drop(*model->blocks, std::to_string(i));
  }
}

at::Tensor run_stage(model::Gpt& model, const StageSpec& stage, const at::Tensor& hidden, const model::Batch& batch,
                     model::LossGradients when) {
  at::Tensor x = stage.embed ? model->embed(batch) : hidden;
  for (int64_t i = stage.first_block; i < stage.end_block; ++i) x = model->block(i, x, batch);
  return stage.head ? model->head_loss(x, batch.targets, when, batch.weight) : x;
}

}  // namespace meshtrain::parallel::pipeline
