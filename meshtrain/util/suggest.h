// "Did you mean": the known word nearest to a mistyped one, for the messages
// that refuse a command, an option or a config key.
#pragma once

#include <string>
#include <vector>

namespace meshtrain::util {

// Edits (insert, delete, replace, swap two neighbours) between a and b.
int edit_distance(const std::string& a, const std::string& b);

// The candidate nearest to `word` when it is near enough to be a slip (at most
// one edit in four letters, at least one; or `word` a prefix of exactly one
// candidate); else "". Ties go to the first candidate.
std::string nearest(const std::string& word, const std::vector<std::string>& candidates);

// " (did you mean X?)" for nearest(word, candidates), or "".
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace meshtrain::util
