#!/bin/sh
# Installs Debian's Chromium and ChromeDriver for tests/test_browser.py when they are missing.
# Outside CI it never fails the build: when it cannot install, it says why and the browser
# test skips. In CI (CI=true) a browser that could not be installed is an error: a skipped
# browser test must not look like a green run.
# (Playwright's own browser download is never used: the test drives /usr/bin/chromium.)
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
case "${CI:-}" in 1|true|TRUE|yes) in_ci=1 ;; *) in_ci=0 ;; esac

give_up() {
    echo "install-browser: $1" >&2
    if [ "$in_ci" = 1 ]; then
        echo "install-browser: CI=true, so this is an error" >&2
        exit 1
    fi
    exit 0
}

if [ -x "$CHROMIUM" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    give_up "$CHROMIUM is missing and this is not root; the browser test will skip (install Debian's chromium and chromium-driver packages to run it)"
fi
if ! command -v apt-get >/dev/null 2>&1; then
    give_up "$CHROMIUM is missing and there is no apt-get; the browser test will skip"
fi
echo "install-browser: installing chromium and chromium-driver with apt-get ..." >&2
log=$(mktemp)
if DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$log" 2>&1 &&
   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       chromium chromium-driver >>"$log" 2>&1 && [ -x "$CHROMIUM" ]; then
    echo "install-browser: installed $("$CHROMIUM" --version 2>/dev/null)" >&2
    rm -f "$log"
else
    echo "install-browser: apt-get failed. Last lines of its output:" >&2
    tail -n 15 "$log" >&2
    rm -f "$log"
    give_up "no browser; the browser test will skip"
fi
exit 0
