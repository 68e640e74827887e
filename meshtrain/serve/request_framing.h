// Where an HTTP/1.1 request ends, told from its bytes as they arrive: what
// Note [Admission] needs to hold a connection until its request is whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace meshtrain::serve {

// Reads a request's bytes incrementally (call inspect() with everything
// received so far, each time more arrives). The request is whole when its
// head (up to the blank line) and its body have arrived: Content-Length
// bytes of it, or chunks up to the last one and its trailers. A request is
// also handed on as "whole" once it is known to be too large (a declared or
// received body past `body_limit`) or its chunked framing is malformed: the
// HTTP server answers those (413, 400) from what is there, and nothing more
// is read. Not thread-safe; one per connection.
class RequestFraming {
 public:
  enum class Verdict {
    kIncomplete,  // more bytes to come
    kWhole,       // hand the bytes to the HTTP server
    kRefuse,      // a head larger than its limit: close the connection
  };
  RequestFraming(size_t head_limit, size_t body_limit);

  Verdict inspect(const std::string& bytes);

  bool head_complete() const { return head_end_ != std::string::npos; }
  // The head asked for "Expect: 100-continue" and a body within the limit is to come.
  bool expects_continue() const { return expects_continue_; }
  // The most bytes a whole request within the limits can take (head, body, chunk framing).
  size_t byte_limit() const;
  // Once the head is complete: the request's size when its body's length is
  // declared (within the limit), else the head's.
  size_t expected_bytes() const { return head_end_ + (body_ == Body::kLength ? length_ : 0); }
  // Once the head is complete: the most body bytes still to be read (the
  // declared length; for chunks, up to byte_limit(); 0 without a body to wait for).
  size_t body_bytes_to_come() const {
    return body_ == Body::kLength ? length_ : body_ == Body::kChunked ? byte_limit() - head_end_ : 0;
  }

 private:
  enum class Body { kNone, kLength, kChunked };
  void parse_head(const std::string& bytes);
  Verdict scan_chunks(const std::string& bytes);

  size_t head_limit_, body_limit_;
  size_t head_end_ = std::string::npos;  // offset of the body's first byte
  Body body_ = Body::kNone;
  uint64_t length_ = 0;         // Content-Length
  bool too_large_ = false;      // declared past the limit
  bool expects_continue_ = false;
  size_t chunk_cursor_ = 0;     // chunked: the next chunk's size line
  uint64_t chunked_bytes_ = 0;  // chunked: body bytes in the chunks scanned
};

}  // namespace meshtrain::serve
