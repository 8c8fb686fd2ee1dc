// The C++ tests' tiny harness (no test framework to fetch at build time):
// CHECK counts and reports failures without stopping; RunTests runs named
// test functions and returns the process's exit status.
#pragma once

#include <cstdio>
#include <initializer_list>
#include <utility>

namespace libra_test {

inline int failures = 0;
inline int checks = 0;

inline int RunTests(std::initializer_list<std::pair<const char*, void (*)()>> tests) {
  for (const auto& [name, fn] : tests) {
    const int before = failures;
    fn();
    std::printf("%-20s %s\n", name, failures == before ? "ok" : "FAILED");
  }
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace libra_test

#define CHECK(cond)                                                                  \
  do {                                                                               \
    ++libra_test::checks;                                                            \
    if (!(cond)) {                                                                   \
      ++libra_test::failures;                                                        \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);  \
    }                                                                                \
  } while (0)
