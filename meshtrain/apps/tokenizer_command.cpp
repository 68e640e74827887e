// meshtrain tokenizer train / encode / decode.
#include "meshtrain/apps/commands.h"

#include "meshtrain/text/tokenizer.h"
#include "meshtrain/util/files.h"

#include <cstdio>

namespace meshtrain::apps {

int run_tokenizer_train(const std::vector<std::string>& inputs, int64_t vocab, const std::string& type,
                        const std::string& prefix) {
  text::train_sentencepiece(inputs, vocab, type, prefix);
  const auto tokenizer = text::load_tokenizer(prefix + ".model");
  std::printf("meshtrain tokenizer: %s -> %s.model (%s); train with --data.tokenizer=%s.model "
              "--model.vocab_size=%lld\n",
              type.c_str(), prefix.c_str(), tokenizer->describe().c_str(), prefix.c_str(),
              static_cast<long long>(tokenizer->vocab_size()));
  return 0;
}

int run_tokenizer_encode(const std::string& spec, const std::string& text, const std::string& file) {
  const auto tokenizer = text::load_tokenizer(spec);
  const std::vector<int64_t> ids = tokenizer->encode(file.empty() ? text : util::read_text_file(file));
  for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? " %lld" : "%lld", static_cast<long long>(ids[i]));
  std::printf("\n");
  return 0;
}

int run_tokenizer_decode(const std::string& spec, const std::vector<int64_t>& ids) {
  std::printf("%s\n", text::load_tokenizer(spec)->decode(ids).c_str());
  return 0;
}

}  // namespace meshtrain::apps
