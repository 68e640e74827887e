// The planner's answers: one layout evaluated (memory per rank and term, time
// per step), and every layout of a world size searched, ranked by predicted
// step time among those that fit the device memory.
#pragma once

#include "meshtrain/plan/layout.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/model/gpt_config.h"
#include "meshtrain/plan/time_model.h"

#include <string>
#include <vector>

namespace meshtrain::plan {

struct Candidate {
  Layout layout;
  int64_t microbatches = 1;        // per data rank per step
  std::vector<RankMemory> ranks;   // per pipeline rank
  RankMemory worst;                // the rank with the highest peak
  TimeBreakdown time;
  bool fits = false;
  std::string why_not;             // when it does not fit: how far over, and its largest term
};

// Evaluates `layout` for `workload.global_batch` sequences on `machine`.
// Throws std::invalid_argument when the layout cannot run this model
// (check_layout) or the batch does not divide into its micro-batches.
Candidate evaluate(const model::GptConfig& model, const Workload& workload, const Layout& layout, const Machine& machine);

struct SearchResult {
  std::vector<Candidate> fitting;   // fastest first
  std::vector<Candidate> rejected;  // closest to fitting first
  int64_t examined = 0;
};

// Every layout of `world` ranks: tp (within a node) x pp x data ranks (of
// them ep, for a mixture-of-experts model: any degree dividing the experts), ZeRO
// stage 0-3 (full or node-local sharding), sequence parallel whenever tp > 1
// allows it, 1F1B and interleaved (v = 2) pipelines, micro-batch sizes
// dividing the batch, no/selective/full recompute, and offload where ZeRO
// allows it.
SearchResult search(const model::GptConfig& model, const Workload& workload, const Machine& machine, int64_t world);

// The default global batch: about a million tokens, a multiple of `world` sequences.
int64_t default_global_batch(const model::GptConfig& model, int64_t world);

}  // namespace meshtrain::plan
