// Uploads in chunks (Note [Messages in chunks]): a round trip and each
// refusal at the chunk that shows it, one upload at a time per client, and a
// result for another round refused at its first chunk.
#include "meshtrain/fl/chunks.h"
#include "meshtrain/fl/server.h"
#include "meshtrain/util/files.h"
#include "tests/fl/raw_client.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace meshtrain::fl {
namespace {

FlConfig upload_config(const std::string& out) {
  return FlConfig::load("", {"model.layers=1", "model.width=32", "model.heads=2", "model.context=16",
                             "fl.server.insecure=true", "fl.server.listen=127.0.0.1:0", "fl.server.out=" + out});
}

// Note [Messages in chunks]: a Result through write_chunks and read_chunks, and
// the refusals, each at the chunk that shows it.
TEST(FlChunks, ARoundTripAndRefusalsAtTheChunkThatShowsThem) {
  wire::Result result;
  result.set_client_id("c0");
  result.set_session("s");
  result.add_update()->set_values(std::string((7 << 20) / 2, '\x01'));  // 3.5 MiB: four chunks
  std::vector<wire::Chunk> chunks;
  ASSERT_TRUE(write_chunks(result, "c0", "s", [&](const wire::Chunk& c) { chunks.push_back(c); return true; }));
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0].total(), result.ByteSizeLong());
  EXPECT_EQ(chunks[0].client_id(), "c0");
  EXPECT_EQ(chunks[1].total(), 0u);
  size_t next = 1, ends_after = chunks.size();
  auto read = [&](wire::Chunk* c) {
    if (next >= ends_after) return false;
    *c = chunks[next++];
    return true;
  };
  wire::Result back;
  ASSERT_TRUE(read_chunks(chunks[0], read, 8 << 20, "a result", &back).ok());
  EXPECT_EQ(back.SerializeAsString(), result.SerializeAsString());

  next = 1;  // declared over the cap: not one more chunk read
  grpc::Status s = read_chunks(chunks[0], read, 2 << 20, "a result", &back);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("over the limit of 2.0 MiB (fl.max_message_mb): refused unread"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(next, 1u);

  next = 1;  // 1.5 MiB declared, more sent: refused at the second chunk
  wire::Chunk lying = chunks[0];
  lying.set_total(3 << 19);
  s = read_chunks(lying, read, 8 << 20, "a result", &back);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("more bytes came than the 1572864 its first chunk declared"), std::string::npos);
  EXPECT_EQ(next, 2u);

  next = 1, ends_after = 2;  // cut off
  s = read_chunks(chunks[0], read, 8 << 20, "a result", &back);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("the stream ended after 2097152 of its"), std::string::npos) << s.error_message();

  wire::Result empty;  // one empty chunk
  chunks.clear();
  write_chunks(empty, "", "", [&](const wire::Chunk& c) { chunks.push_back(c); return true; });
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_TRUE(read_chunks(chunks[0], read, 8 << 20, "a result", &back).ok());
}

// The chunks of a 1.5 MiB FIT result of `client` (as "c0") answering `round`: two chunks.
std::vector<wire::Chunk> two_chunk_result(const RawClient& client, uint64_t round) {
  wire::Result result;
  result.set_client_id("c0");
  result.set_session(client.session);
  result.set_round(round);
  result.set_kind(wire::Task::FIT);
  result.add_update()->set_values(std::string(3 << 19, '\0'));
  std::vector<wire::Chunk> chunks;
  write_result_chunks(result, [&](const wire::Chunk& c) { chunks.push_back(c); return true; });
  return chunks;
}

// Note [Messages in chunks]: one upload at a time per client, so that a client
// cannot make the server hold the cap several times over.
TEST(FlFederation, AClientUploadsOneResultAtATime) {
  const std::string dir = ::testing::TempDir() + "/fl_one_upload";
  util::remove_tree(dir);
  FlConfig config = upload_config(dir + "/out");
  config.rounds = 1;
  config.min_available = 1;
  config.deadline_s = 5;
  Server server(config);
  RawClient client(server.port());
  ASSERT_TRUE(client.join("c0", 100).ok());
  std::thread rounds([&] { server.run(); });
  wire::Task task;
  while (task.kind() != wire::Task::FIT) ASSERT_TRUE(client.poll("c0", &task).ok());
  const std::vector<wire::Chunk> chunks = two_chunk_result(client, task.round());
  ASSERT_EQ(chunks.size(), 2u);
  grpc::ClientContext first_context, second_context;
  wire::Ack ack;
  auto first = client.stub->SubmitChunks(&first_context, &ack);
  ASSERT_TRUE(first->Write(chunks[0]));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the server has taken the first chunk
  auto second = client.stub->SubmitChunks(&second_context, &ack);
  second->Write(chunks[0]);
  second->WritesDone();
  const grpc::Status refused = second->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("is uploading one already"), std::string::npos) << refused.error_message();
  ASSERT_TRUE(first->Write(chunks[1]));
  first->WritesDone();
  EXPECT_TRUE(first->Finish().ok());
  while (task.kind() != wire::Task::STOP) ASSERT_TRUE(client.poll("c0", &task).ok());  // the server ends at once
  rounds.join();
}

// The first chunk names the round and phase its result answers: one for
// another is refused there, before the rest is sent.
TEST(FlFederation, AResultForAnotherRoundIsRefusedAtItsFirstChunk) {
  const std::string dir = ::testing::TempDir() + "/fl_first_chunk";
  util::remove_tree(dir);
  FlConfig config = upload_config(dir + "/out");
  config.rounds = 1;
  config.deadline_s = 1;
  Server server(config);
  RawClient client(server.port());
  ASSERT_TRUE(client.join("c0", 100).ok());
  std::thread rounds([&] { server.run(); });
  wire::Task task;
  while (task.kind() != wire::Task::FIT) ASSERT_TRUE(client.poll("c0", &task).ok());
  const std::vector<wire::Chunk> chunks = two_chunk_result(client, task.round() + 1);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].round(), task.round() + 1);
  grpc::ClientContext context;
  wire::Ack ack;
  auto upload = client.stub->SubmitChunks(&context, &ack);
  upload->Write(chunks[0]);  // and no more: a server that waited for the rest would see the stream end early
  upload->WritesDone();
  const grpc::Status refused = upload->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("result for round 2 FIT refused: the server is at round 1 FIT"),
            std::string::npos) << refused.error_message();
  while (task.kind() != wire::Task::STOP) ASSERT_TRUE(client.poll("c0", &task).ok());
  rounds.join();
}

}  // namespace
}  // namespace meshtrain::fl
