#include "meshtrain/util/suggest.h"

#include <algorithm>
#include <cstddef>

namespace meshtrain::util {

int edit_distance(const std::string& a, const std::string& b) {
  // Optimal string alignment: three rows of the dynamic program.
  const size_t n = a.size(), m = b.size();
  std::vector<int> before(m + 1), last(m + 1), row(m + 1);
  for (size_t j = 0; j <= m; ++j) last[j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i) {
    row[0] = static_cast<int>(i);
    for (size_t j = 1; j <= m; ++j) {
      const int replace = last[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      row[j] = std::min({last[j] + 1, row[j - 1] + 1, replace});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) row[j] = std::min(row[j], before[j - 2] + 1);
    }
    std::swap(before, last);
    std::swap(last, row);
  }
  return last[m];
}

std::string nearest(const std::string& word, const std::vector<std::string>& candidates) {
  if (word.empty()) return "";
  const int allowed = std::max<int>(1, static_cast<int>(word.size()) / 4);
  std::string best;
  int best_distance = allowed + 1;
  for (const std::string& c : candidates) {
    const int d = edit_distance(word, c);
    if (d < best_distance) best = c, best_distance = d;
  }
  if (!best.empty()) return best;
  std::string prefixed;
  for (const std::string& c : candidates) {
    if (c.size() > word.size() && c.compare(0, word.size(), word) == 0) {
      if (!prefixed.empty()) return "";  // ambiguous
      prefixed = c;
    }
  }
  return prefixed;
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  const std::string near = nearest(word, candidates);
  return near.empty() ? "" : " (did you mean " + near + "?)";
}

}  // namespace meshtrain::util
