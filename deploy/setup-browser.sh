#!/usr/bin/env bash
# Debian's Chromium for the readout page's browser test (tests/test_read.py drives it with Playwright, no browser
# download). Installed when missing and this is a root shell with apt-get; otherwise that one test is skipped.
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing Debian's chromium (the readout page's browser test)"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
    || echo "setup: chromium did not install; the browser test will be skipped"
else
  echo "setup: no chromium (apt-get install chromium as root); the browser test will be skipped"
fi
exit 0
