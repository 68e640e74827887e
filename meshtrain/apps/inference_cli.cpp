#include "meshtrain/apps/inference_cli.h"

#include "meshtrain/apps/offload_flags.h"

#include "meshtrain/plan/layout.h"

namespace meshtrain::apps {

InferenceCli::InferenceCli(CLI::App& app, CLI::App& bench) {
  add_bench(bench);
  add_generate(app);
  add_serve(app);
  add_interop(app);
  add_tokenizer(app);
  add_logits(app);
}

void InferenceCli::add_bench(CLI::App& bench) {
  bench_generate_ = bench.add_subcommand(
      "generate",
      "Prefill and decode timed apart on the serving path (continuous-batching engine, KV cache, greedy): "
      "a batch of the same prompt, medians of --trials, one JSON line with row 0's tokens "
      "(bench/generate_vs_hf.py runs transformers' generate() on the same weights beside it)");
  bench_generate_->add_option("--checkpoint", bench_.checkpoint, "Checkpoint folder or directory")->required();
  bench_generate_->add_option("--batch", bench_.batch, "Sequences")->check(CLI::PositiveNumber)->capture_default_str();
  bench_generate_->add_option("--prompt-tokens", bench_.prompt_tokens, "Prompt length")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bench_generate_->add_option("--new-tokens", bench_.new_tokens, "Tokens to generate")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str();
  bench_generate_->add_option("--warmup", bench_.warmup, "Untimed runs")->capture_default_str();
  bench_generate_->add_option("--trials", bench_.trials, "Timed runs")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bench_generate_->add_option("--json", bench_.json_path, "Also append the JSON line to this file");
  add_offload_flags(*bench_generate_, bench_.offload);
}

void InferenceCli::add_generate(CLI::App& app) {
  generate_app_ = app.add_subcommand(
      "generate",
      "Sample text from a checkpoint, streamed as it comes (temperature, top-k, top-p, seed, stop strings; "
      "split over ranks with --parallel.tp)");
  generate_app_
      ->add_option("--checkpoint", generate_.checkpoint,
                   "Checkpoint folder, or a checkpoint directory (its latest is used)")
      ->required();
  generate_app_->add_option("--prompt", generate_.prompt, "Text to continue")->capture_default_str();
  generate_app_->add_option("--tokens,--max-tokens", generate_.tokens, "The most tokens to generate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  generate_app_
      ->add_option("--temperature", generate_.temperature, "Softmax temperature (0: greedy, the likeliest token)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  generate_app_->add_option("--top-k", generate_.top_k, "Sample among the k likeliest tokens (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  generate_app_
      ->add_option("--top-p", generate_.top_p,
                   "Sample among the likeliest tokens whose probabilities sum to p (nucleus sampling; 1: off)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  generate_app_->add_option("--seed", generate_.seed, "Sampling seed")->capture_default_str();
  generate_app_->add_option("--stop", generate_.stop,
                            "End the text before this string (repeat for several; the stop string is not printed)");
  generate_app_
      ->add_option("--parallel.tp", generate_.tp,
                   "Split the model over this many ranks by tensor parallelism (all ranks of the job: "
                   "meshtrain run -n 2 generate --parallel.tp=2 ...)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  generate_app_->add_flag("--no-kv-cache", generate_.no_kv_cache,
                          "Recompute the whole context for every new token instead of keeping keys and values (slower; "
                          "the same tokens)");
  generate_app_->add_flag("--timing", generate_.timing, "Print the tokens per second to stderr");
  add_offload_flags(*generate_app_, generate_.offload);
}

void InferenceCli::add_serve(CLI::App& app) {
  serve_app_ = app.add_subcommand(
      "serve",
      "Serve a checkpoint over an OpenAI-compatible HTTP API: POST /v1/completions (stream: true for "
      "server-sent events), GET /v1/models, GET /health. Requests join the running batch between decode "
      "steps (continuous batching). SIGTERM or Ctrl-C finishes the requests in flight, then exits 0.");
  serve_app_
      ->add_option("--checkpoint", serve_.checkpoint,
                   "Checkpoint folder, or a checkpoint directory (its latest is used)")
      ->required();
  serve_app_->add_option("--host", serve_.host, "Address to listen on")->capture_default_str();
  serve_app_->add_option("--port", serve_.port, "Port (0: any free port, printed at start)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  serve_app_->add_option("--max-batch", serve_.max_batch, "Sequences decoded together")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  serve_app_->add_option("--queue", serve_.queue, "Requests waiting beyond the batch; more get 429")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  serve_app_
      ->add_option("--parallel.tp", serve_.tp,
                   "Split the model over this many ranks (all ranks of the job: meshtrain run -n 2 serve "
                   "--parallel.tp=2 ...)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  serve_app_->add_option("--model-name", serve_.model_name, "The model's name in the API")->capture_default_str();
  serve_app_->add_option("--threads", serve_.threads, "HTTP handler threads (0: max-batch + queue + 4)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  serve_app_->add_flag("--log", serve_.log, "Print a line per request to stderr");
  add_offload_flags(*serve_app_, serve_.offload);
}

void InferenceCli::add_interop(CLI::App& app) {
  CLI::App* import = app.add_subcommand("import", "Bring a model trained elsewhere in as a meshtrain checkpoint");
  import->require_subcommand(1);
  import_hf_ = import->add_subcommand(
      "hf",
      "A Hugging Face transformers folder (config.json + model.safetensors, or shards with "
      "model.safetensors.index.json) of a GPT-2 or Llama model (grouped-query attention included)");
  import_hf_->add_option("dir", import_dir_, "The Hugging Face model folder")
      ->required()
      ->check(CLI::ExistingDirectory);
  import_hf_->add_option("--out", import_out_, "Checkpoint directory to write (step 0, with a latest pointer)")
      ->required();
  CLI::App* export_ = app.add_subcommand("export", "Hand a meshtrain checkpoint to other tools");
  export_->require_subcommand(1);
  export_hf_ = export_->add_subcommand(
      "hf",
      "As a Hugging Face transformers folder (GPT2LMHeadModel or LlamaForCausalLM): config.json and "
      "safetensors, sharded with an index when larger than --max-shard-size");
  export_hf_->add_option("checkpoint", export_checkpoint_, "Checkpoint folder, or a checkpoint directory (its latest)")
      ->required();
  export_hf_->add_option("--out", export_out_, "Folder to write")->required();
  export_hf_->add_option("--dtype", export_dtype_, "float32, bfloat16 or float16")->capture_default_str();
  export_hf_->add_option("--max-shard-size", export_shard_, "Largest safetensors file (e.g. 500M, 5G)")
      ->capture_default_str();
}

void InferenceCli::add_tokenizer(CLI::App& app) {
  tokenizer_ = app.add_subcommand("tokenizer", "Train and try tokenizers");
  tokenizer_->require_subcommand(1);
  tok_train_ = tokenizer_->add_subcommand(
      "train",
      "Train a SentencePiece model on text files (byte fallback on: any text encodes); writes OUT.model "
      "and OUT.vocab. Use it with [data] tokenizer = \"OUT.model\" and model.vocab_size = --vocab.");
  tok_train_->add_option("inputs", tok_inputs_, "Text files")->required()->check(CLI::ExistingFile);
  tok_train_->add_option("--vocab", tok_vocab_, "Vocabulary size")->check(CLI::Range(64, 65536))->capture_default_str();
  tok_train_->add_option("--type", tok_type_, "unigram or bpe")->capture_default_str();
  tok_train_->add_option("--out", tok_out_, "Output prefix")->required();
  tok_encode_ = tokenizer_->add_subcommand("encode", "Print the token ids of a text");
  tok_encode_->add_option("--tokenizer", tok_spec_, "As [data] tokenizer")->capture_default_str();
  tok_encode_->add_option("--text", tok_text_, "The text");
  tok_encode_->add_option("--file", tok_file_, "Or a file's text")->check(CLI::ExistingFile);
  tok_decode_ = tokenizer_->add_subcommand("decode", "Print the text of token ids");
  tok_decode_->add_option("--tokenizer", tok_spec_, "As [data] tokenizer")->capture_default_str();
  tok_decode_->add_option("ids", tok_ids_, "Token ids")->required();
}

void InferenceCli::add_logits(CLI::App& app) {
  logits_ =
      app.add_subcommand("logits",
                         "Write the logits [1, T, vocab] of a token sequence to a safetensors file (to compare with "
                         "another implementation)");
  logits_->add_option("--checkpoint", logits_checkpoint_, "Checkpoint folder or directory")->required();
  logits_->add_option("--tokens", logits_tokens_, "Token ids separated by commas, e.g. 1,2,3")->required();
  logits_->add_option("--out", logits_out_, "The safetensors file to write (tensor \"logits\")")->required();
}

bool InferenceCli::parsed() const {
  for (const CLI::App* sub :
       {generate_app_, serve_app_, import_hf_, export_hf_, tokenizer_, logits_, bench_generate_}) {
    if (sub->parsed()) return true;
  }
  return false;
}

bool InferenceCli::wants_mpi() const { return generate_app_->parsed() || serve_app_->parsed() || import_hf_->parsed(); }

bool InferenceCli::serving() const { return serve_app_->parsed(); }

int InferenceCli::run_without_mpi() const {
  if (bench_generate_->parsed()) return run_bench_generate(bench_);
  if (tok_train_->parsed()) return run_tokenizer_train(tok_inputs_, tok_vocab_, tok_type_, tok_out_);
  if (tok_encode_->parsed()) return run_tokenizer_encode(tok_spec_, tok_text_, tok_file_);
  if (tok_decode_->parsed()) return run_tokenizer_decode(tok_spec_, tok_ids_);
  if (logits_->parsed()) return run_logits(logits_checkpoint_, logits_tokens_, logits_out_);
  return run_export_hf(export_checkpoint_, export_out_, export_dtype_,
                       static_cast<int64_t>(plan::parse_bytes(export_shard_)));
}

int InferenceCli::run_with_mpi(comm::Runtime& runtime) const {
  if (generate_app_->parsed()) return run_generate(runtime, generate_);
  if (serve_app_->parsed()) return run_serve(runtime, serve_);
  return run_import_hf(runtime, import_dir_, import_out_);
}

}  // namespace meshtrain::apps
