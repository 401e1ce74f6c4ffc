# Sourced by `make test` (POSIX sh) before pytest: the dashboard's browser tests need Debian's `chromium`.
# Where it is missing, install it if we can (root with apt-get, as on CI); otherwise say, before the tests
# start, which tests will be skipped and why, and skip them (MICROGPT_SKIP_BROWSER=1) instead of failing.
# On CI (CI=true) nothing is skipped: a browser that cannot be installed fails those tests.
has_chromium() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }
if [ "${MICROGPT_SKIP_BROWSER:-}" != 1 ] && ! has_chromium; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "make test: installing Debian's chromium for the dashboard's browser tests (apt-get install chromium)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
  if ! has_chromium && [ "${CI:-}" = true ]; then
    echo "make test: chromium could not be installed: on CI the dashboard's browser tests will FAIL"
  elif ! has_chromium; then
    echo "make test: chromium is not installed and could not be installed here (that takes root and apt-get):" \
      "the dashboard's browser tests (the 'browser' fixture, tests/proxy/test_dashboard_browser.py) will be" \
      "SKIPPED; install Debian's chromium to run them"
    MICROGPT_SKIP_BROWSER=1
    export MICROGPT_SKIP_BROWSER
  fi
fi
