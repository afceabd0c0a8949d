#!/bin/sh
# Make Debian's Chromium available for the browser tests (tests/browser), which drive
# it through Playwright at /usr/bin/chromium (or $VARBATCH_CHROMIUM).
#
# Installs it with apt-get when it is missing and we are root; runs `apt-get update`
# only when the install fails without it. Never fails the build: when Chromium cannot
# be installed, the browser tests are skipped and pytest prints why.
CHROMIUM="${VARBATCH_CHROMIUM:-/usr/bin/chromium}"
LOG=build/chromium-install.log

[ -x "$CHROMIUM" ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "ensure_chromium: $CHROMIUM is missing and this is not root: browser tests will be skipped"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: $CHROMIUM is missing and there is no apt-get: browser tests will be skipped"
    exit 0
fi
mkdir -p build
T=""
command -v timeout >/dev/null 2>&1 && T="timeout 900"
APT="$T apt-get -o DPkg::Lock::Timeout=120"
export DEBIAN_FRONTEND=noninteractive
echo "ensure_chromium: installing chromium with apt-get (log: $LOG) ..."
if $APT install -y chromium >"$LOG" 2>&1 \
    || { $APT update >>"$LOG" 2>&1 && $APT install -y chromium >>"$LOG" 2>&1; }; then
    echo "ensure_chromium: installed $("$CHROMIUM" --version 2>/dev/null)"
else
    echo "ensure_chromium: apt-get could not install chromium (see $LOG): browser tests will be skipped"
fi
exit 0
