// The Jinja interpreter's failures: each is an Error naming its line, and a
// template that raises says its own message.
#include <gtest/gtest.h>

#include "meshtrain/text/jinja/template.h"

namespace meshtrain::text::jinja {
namespace {

std::string render(const std::string& source, const Dict& globals = {}) { return Template(source).render(globals); }

std::string error_of(const std::string& source) {
  try {
    render(source, {{"m", Value::dict({{"role", Value("user")}})}});
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Jinja, RendersWithPythonSemantics) {
  EXPECT_EQ(render("{{ 7 // -2 }} {{ -7 % 3 }} {{ 1 / 4 }} {{ 'a' ~ 1 ~ none }} {{ [1, 'b'] }} {{ (1,) }}"),
            "-4 2 0.25 a1None [1, 'b'] (1,)");
  EXPECT_EQ(render("{% for x in [1, 2] %}{% set y = x %}{% endfor %}[{{ y }}]"), "[]");  // loop-local
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for x in [1, 2] %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}"),
            "3");
  EXPECT_EQ(render("  {% if true %}\n  x\n  {% endif %}\n"), "  x\n");  // trim_blocks + lstrip_blocks
}

TEST(Jinja, FailuresNameTheirLine) {
  EXPECT_EQ(error_of("line one\n{{ raise_exception('roles must alternate') }}"), "roles must alternate");
  EXPECT_NE(error_of("\n{{ m.missing.deeper }}").find("line 2"), std::string::npos);
  EXPECT_NE(error_of("{{ m|no_such_filter }}").find("no filter named 'no_such_filter'"), std::string::npos);
  EXPECT_NE(error_of("{{ m.role + 1 }}").find("unsupported operand"), std::string::npos);
  EXPECT_NE(error_of("a\n{% if true %}never closed").find("missing {% endif %}"), std::string::npos);
  EXPECT_NE(error_of("{{ 1 / 0 }}").find("division by zero"), std::string::npos);
  EXPECT_NE(error_of("{% for x in 3 %}{% endfor %}").find("not iterable"), std::string::npos);
  EXPECT_EQ(error_of("{{ m.missing is defined }} {{ undefined_name }}"), "(no error)");
}

}  // namespace
}  // namespace meshtrain::text::jinja
