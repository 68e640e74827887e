// The model's keys, listed once (Note [Model keys]): the TOML [model] section
// and --help, the checkpoint's JSON, the fingerprint's family part, the
// federated [model] section and the Hugging Face config's plain keys all
// derive from this table.
#pragma once

#include "meshtrain/model/gpt_config.h"
#include "meshtrain/util/config_keys.h"

#include <functional>
#include <string>
#include <vector>

namespace meshtrain::model {

// Note [Model keys]
// ~~~~~~~~~~~~~~~~~
// Each field of GptConfig a person may set is one ModelKey: its `[model]`
// key (name, kind, help; a config::Key as ParallelSpec's are) and where the
// checkpoint's JSON keeps it. The JSON was written before the table and stays
// readable both ways: the first keys of the format are always written and
// required on reading; keys added later are optional on reading (absent: the
// default); the experts' keys sit under "moe" with shorter names, written
// when the model has experts; the families' keys (Note [Model families]) are
// written only where they differ from the default, so that a plain model's
// JSON, and its fingerprint, are what they were. Adding a knob is: the field,
// its line here, its rule in GptConfig::validate.
//
// A key the Llama-style families' config.json holds under a name of its own
// with the same value carries that name (`hf`): import reads it and export
// writes it from the table. The keys Hugging Face spells another way (kv_heads
// 0 for "as many as heads", the rope parameters, windows per layer, the
// experts' sizes) or only some families carry are written out in
// interop/hf_families.cpp. Whether an exported model reads back as the same
// model is asked of every key here that changes what it computes (`computes`:
// not dropout or the router's training losses).
struct ModelKey {
  enum class Stored {
    kRequired,   // written always, required on reading (the format's first keys)
    kAlways,     // written always, optional on reading (added later)
    kExperts,    // under "moe": written with experts
    kExpertsOptional,  // under "moe", optional on reading (added later)
    kWhenSet,    // written where it differs from the default (the families' keys)
    kNotStored,  // how to compute, not what: not in the checkpoint (model.fused)
  };
  config::Key<GptConfig> key;  // section "model"
  Stored stored;
  std::string json;            // its name in the JSON (under "moe" for the experts' keys)
  std::function<config::Value(const GptConfig&)> get;
  std::string hf;            // its name in a Llama-style config.json ("": none, or not one to one)
  bool hf_required = false;  // config.json must hold it (else: absent keeps the family's default)
  bool computes = true;      // false: it shapes training only (dropout, the router's losses)
};

// Every key, in the order --help lists them.
const std::vector<ModelKey>& model_keys();
// The key named `name` in [model]; null when there is none.
const ModelKey* find_model_key(const std::string& name);
// Whether the key's value in `a` and `b` differ.
bool differs(const ModelKey& key, const GptConfig& a, const GptConfig& b);

}  // namespace meshtrain::model
