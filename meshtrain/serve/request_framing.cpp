#include "meshtrain/serve/request_framing.h"

#include <algorithm>
#include <cctype>

namespace meshtrain::serve {

namespace {

constexpr size_t kChunkLineLimit = 1024;  // a chunk's size line, extensions included

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

}  // namespace

RequestFraming::RequestFraming(size_t head_limit, size_t body_limit) : head_limit_(head_limit), body_limit_(body_limit) {}

size_t RequestFraming::byte_limit() const {
  // Chunk framing (a size line and CRLF per chunk) may take as much again as
  // the body, and a little more; a body in chunks so small that their
  // framing passes that is handed on cut short (the server answers 400).
  return head_limit_ + 2 * body_limit_ + 64 * 1024;
}

void RequestFraming::parse_head(const std::string& bytes) {
  const std::string head = bytes.substr(0, head_end_);
  size_t line = head.find("\r\n");  // past the request line
  while (line != std::string::npos && line + 2 < head.size()) {
    const size_t next = head.find("\r\n", line + 2);
    const std::string field = head.substr(line + 2, (next == std::string::npos ? head.size() : next) - line - 2);
    line = next;
    const size_t colon = field.find(':');
    if (colon == std::string::npos) continue;
    const std::string name = lower(trim(field.substr(0, colon)));
    const std::string value = trim(field.substr(colon + 1));
    if (name == "transfer-encoding" && lower(value).find("chunked") != std::string::npos) {
      body_ = Body::kChunked;  // takes precedence over a Content-Length (RFC 9112, 6.3)
    } else if (name == "content-length" && body_ != Body::kChunked) {
      const bool digits = !value.empty() && value.find_first_not_of("0123456789") == std::string::npos;
      if (!digits) continue;  // the HTTP server refuses it
      if (value.size() > 18 || std::stoull(value) > body_limit_) {
        too_large_ = true;
      } else {
        length_ = std::stoull(value);
        body_ = length_ > 0 ? Body::kLength : Body::kNone;
      }
    } else if (name == "expect" && lower(value) == "100-continue") {
      expects_continue_ = true;
    }
  }
  if (too_large_ && body_ != Body::kChunked) body_ = Body::kNone;
  if (body_ == Body::kNone) expects_continue_ = false;
  chunk_cursor_ = head_end_;
}

RequestFraming::Verdict RequestFraming::scan_chunks(const std::string& bytes) {
  while (true) {
    const size_t eol = bytes.find("\r\n", chunk_cursor_);
    if (eol == std::string::npos) {
      return bytes.size() - chunk_cursor_ > kChunkLineLimit ? Verdict::kWhole : Verdict::kIncomplete;
    }
    std::string size_text = bytes.substr(chunk_cursor_, eol - chunk_cursor_);
    size_text = trim(size_text.substr(0, size_text.find(';')));  // extensions are ignored
    if (size_text.empty() || size_text.size() > 15 ||
        size_text.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
      return Verdict::kWhole;  // malformed: the server answers 400
    }
    const uint64_t size = std::stoull(size_text, nullptr, 16);
    const size_t data = eol + 2;
    if (size == 0) {  // the last chunk, then trailers up to an empty line
      if (bytes.compare(data, 2, "\r\n") == 0) return Verdict::kWhole;
      const size_t end = bytes.find("\r\n\r\n", data);
      if (end != std::string::npos) return Verdict::kWhole;
      return bytes.size() - data > head_limit_ ? Verdict::kWhole : Verdict::kIncomplete;
    }
    if (chunked_bytes_ + size > body_limit_) {  // too large: whole once the bytes past the limit are here (413)
      return chunked_bytes_ + (bytes.size() - data) > body_limit_ ? Verdict::kWhole : Verdict::kIncomplete;
    }
    if (bytes.size() < data + size + 2) return Verdict::kIncomplete;
    chunked_bytes_ += size;
    chunk_cursor_ = data + size + 2;
  }
}

RequestFraming::Verdict RequestFraming::inspect(const std::string& bytes) {
  if (!head_complete()) {
    const size_t end = bytes.find("\r\n\r\n");
    if (end == std::string::npos || end + 4 > head_limit_) {
      return bytes.size() > head_limit_ ? Verdict::kRefuse : Verdict::kIncomplete;
    }
    head_end_ = end + 4;
    parse_head(bytes);
  }
  if (bytes.size() > byte_limit()) return Verdict::kWhole;
  switch (body_) {
    case Body::kNone:
      return Verdict::kWhole;
    case Body::kLength:
      return bytes.size() >= head_end_ + length_ ? Verdict::kWhole : Verdict::kIncomplete;
    case Body::kChunked:
      return scan_chunks(bytes);
  }
  return Verdict::kWhole;
}

}  // namespace meshtrain::serve
