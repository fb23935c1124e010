#!/bin/sh
# CTest splits the names doctest_discover_tests finds at ';': a test case whose name holds
# one would be registered as pieces that match no test case, and pass without running.
# Usage: check_test_names.sh PIPEPLAN_TESTS_BINARY
if "$1" --list-test-cases | grep ';'; then
  echo "test case names above hold ';': CTest would not run them" >&2
  exit 1
fi
