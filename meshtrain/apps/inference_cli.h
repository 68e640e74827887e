// The command line of the inference subcommands: generate, serve, import hf,
// export hf, tokenizer, logits and bench generate.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "meshtrain/apps/commands.h"

namespace meshtrain::apps {

class InferenceCli {
 public:
  // Adds the subcommands to `app` (bench generate to `bench`).
  InferenceCli(CLI::App& app, CLI::App& bench);

  bool parsed() const;     // one of them is the command given
  bool wants_mpi() const;  // generate, serve and import run with a Runtime (ranks)
  bool serving() const;    // serve: the stop signals must be blocked before MPI starts threads
  int run_without_mpi() const;
  int run_with_mpi(comm::Runtime& runtime) const;

 private:
  void add_bench(CLI::App& bench);
  void add_generate(CLI::App& app);
  void add_serve(CLI::App& app);
  void add_interop(CLI::App& app);
  void add_tokenizer(CLI::App& app);
  void add_logits(CLI::App& app);

  GenerateOptions generate_;
  ServeOptions serve_;
  GenerateBenchOptions bench_;
  std::string import_dir_, import_out_, export_checkpoint_, export_out_, export_dtype_ = "float32",
                                                                         export_shard_ = "5G";
  std::vector<std::string> tok_inputs_;
  int64_t tok_vocab_ = 8000;
  std::string tok_type_ = "unigram", tok_out_, tok_spec_ = "bytes", tok_text_, tok_file_;
  std::vector<int64_t> tok_ids_;
  std::string logits_checkpoint_, logits_tokens_, logits_out_;
  CLI::App *generate_app_, *serve_app_, *import_hf_, *export_hf_, *tokenizer_, *tok_train_, *tok_encode_, *tok_decode_,
      *logits_, *bench_generate_;
};

}  // namespace meshtrain::apps
