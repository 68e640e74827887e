// Small POSIX file helpers. See Note [No std::filesystem].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::util {

// Note [No std::filesystem]
// The torch wheel's libtorch.so exports its own build of 64 std::filesystem
// functions (remove_all, rename, create_directories, ...), compiled against
// another libstdc++. Symbols resolve to libtorch's copy first, so any
// std::filesystem call in a program linked with libtorch runs code built for
// different library internals: remove_all crashed here. meshtrain therefore uses
// these POSIX-based helpers instead, everywhere (tests included).

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
bool is_regular_file(const std::string& path);
int64_t file_size(const std::string& path);  // throws if missing

void make_directories(const std::string& path);  // mkdir -p; throws on failure
void remove_tree(const std::string& path);       // rm -rf; a missing path is fine
void rename_path(const std::string& from, const std::string& to);  // atomic within a file system
void fsync_path(const std::string& path);        // file or directory; best effort

// Writes `text` to path + ".tmp", syncs it and renames it over `path`: a
// reader sees the old file or the whole new one. Throws std::runtime_error.
void write_text_file(const std::string& path, const std::string& text);
// The whole file; throws std::runtime_error "PATH: cannot be read (reason)".
std::string read_text_file(const std::string& path);

// Entry names (not paths) in `dir`, sorted; "." and ".." excluded.
std::vector<std::string> list_directory(const std::string& dir);
std::string join_path(const std::string& a, const std::string& b);
std::string base_name(const std::string& path);
std::string canonical_path(const std::string& path);  // realpath; the path itself if that fails
// The program to start again for a process whose /proc/self/exe reads
// `link_target`: the same path, less the " (deleted)" the kernel appends once
// the file was replaced (a rebuild or reinstall while a job runs), so that a
// relaunch starts the program now at that path rather than failing to exec.
std::string executable_now_at(const std::string& link_target);
// A new empty directory under /tmp (or $TMPDIR) whose name starts with `prefix`.
std::string make_temp_directory(const std::string& prefix);

}  // namespace meshtrain::util
