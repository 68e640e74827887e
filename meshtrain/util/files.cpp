#include "meshtrain/util/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace meshtrain::util {

namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

}  // namespace

bool path_exists(const std::string& path) {
  struct stat info {};
  return lstat(path.c_str(), &info) == 0;
}

bool is_directory(const std::string& path) {
  struct stat info {};
  return stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool is_regular_file(const std::string& path) {
  struct stat info {};
  return stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

int64_t file_size(const std::string& path) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) fail("cannot stat", path);
  return static_cast<int64_t>(info.st_size);
}

void make_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  const size_t slash = path.find_last_of('/');
  if (slash != std::string::npos && slash > 0) make_directories(path.substr(0, slash));
  if (mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) fail("cannot create directory", path);
}

void remove_tree(const std::string& path) {
  if (!path_exists(path)) return;
  // A file another process removed meanwhile (a rank cleaning up its own) is removed.
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) {
    return ::remove(p) == 0 || errno == ENOENT ? 0 : -1;
  };
  if (nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) fail("cannot remove", path);
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail("cannot rename " + from + " to", to);
}

void fsync_path(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  fsync(fd);
  close(fd);
}

std::vector<std::string> list_directory(const std::string& dir) {
  DIR* handle = opendir(dir.c_str());
  if (!handle) fail("cannot list directory", dir);
  std::vector<std::string> names;
  while (const dirent* entry = readdir(handle)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(handle);
  std::sort(names.begin(), names.end());
  return names;
}

std::string join_path(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

std::string base_name(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

std::string canonical_path(const std::string& path) {
  char resolved[PATH_MAX];
  return realpath(path.c_str(), resolved) ? std::string(resolved) : path;
}

std::string executable_now_at(const std::string& link_target) {
  const std::string deleted = " (deleted)";
  const size_t n = link_target.size();
  if (n <= deleted.size() || link_target.compare(n - deleted.size(), deleted.size(), deleted) != 0) return link_target;
  if (path_exists(link_target)) return link_target;  // a file really named so
  return link_target.substr(0, n - deleted.size());
}

std::string make_temp_directory(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = join_path(tmp && *tmp ? tmp : "/tmp", prefix + "XXXXXX");
  if (!mkdtemp(pattern.data())) fail("cannot create a temporary directory like", pattern);
  return pattern;
}

void write_text_file(const std::string& path, const std::string& text) {
  const std::string staging = path + ".tmp";
  {
    std::ofstream out(staging, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw std::runtime_error("cannot write " + staging);
  }
  fsync_path(staging);
  rename_path(staging, path);
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot be read (" + std::strerror(errno) + ")");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace meshtrain::util
