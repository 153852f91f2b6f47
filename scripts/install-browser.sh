#!/bin/sh
# Installs Debian's Chromium and ChromeDriver for tests/test_browser.py when they are missing.
# Never fails the build: when it cannot install, it says why and the browser test skips.
# (Playwright's own browser download is never used: the test drives /usr/bin/chromium.)
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}

if [ -x "$CHROMIUM" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-browser: $CHROMIUM is missing and this is not root; the browser test will skip" \
         "(install Debian's chromium and chromium-driver packages to run it)" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-browser: $CHROMIUM is missing and there is no apt-get; the browser test will skip" >&2
    exit 0
fi
echo "install-browser: installing chromium and chromium-driver with apt-get ..." >&2
log=$(mktemp)
if DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$log" 2>&1 &&
   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       chromium chromium-driver >>"$log" 2>&1; then
    echo "install-browser: installed $("$CHROMIUM" --version 2>/dev/null)" >&2
else
    echo "install-browser: apt-get failed; the browser test will skip. Last lines of its output:" >&2
    tail -n 15 "$log" >&2
fi
rm -f "$log"
exit 0
