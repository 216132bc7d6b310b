#!/usr/bin/env bash
# Debian packages the audio tests read: pocketsphinx-testdata (LibriVox speech with transcripts)
# and espeak-ng (speech in other languages for translations). Installed only when missing; the
# tests skip with the reason where this machine cannot install them.
set -euo pipefail

missing=()
[ -f /usr/share/pocketsphinx/test/data/librivox/transcription ] || missing+=(pocketsphinx-testdata)
command -v espeak-ng >/dev/null 2>&1 || missing+=(espeak-ng)
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-data: no apt-get; the audio tests will skip (missing: ${missing[*]})"
    exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo -n"
echo "install-test-data: installing ${missing[*]}"
if ! { $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }; }; then
    echo "install-test-data: could not install ${missing[*]}; the audio tests will skip"
fi
