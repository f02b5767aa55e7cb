#!/usr/bin/env bash
# Build llama.cpp from llama-cpp-python's sdist for this host's CPU, once: its shared
# libraries for the Python bindings (llama-cpp-python, the benchmark's control engine,
# installed into .venv) and its llama-imatrix, llama-quantize and llama-server into
# .venv/share/edgepath/llama.cpp/bin (the control's imatrix Q4_0: the bindings cannot hand
# the quantizer an importance matrix; `edgepath serve` and the serving benchmark:
# llama.cpp's own OpenAI-compatible server); copy llama.cpp's HF -> GGUF converter out
# of the same sdist into .venv/share/edgepath/llama.cpp.
# Idempotent: skipped while .venv/.edgepath-llama-cpp names this version and these flags.
# Built twice before (bindings 6 min 28 s, then the tools statically, 5 min 40 s, on the
# AVX2 host); once, the tools add only their own units to the bindings' build.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.3.36
# Pinned so a changed or tampered archive is refused, not built.
sdist_sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

# The CPU kernels for this host's ISA, named explicitly rather than -march=native:
# - AMX off: GCC 12's _tile_loadconfig reads 8 of the 64-byte tile config, so llama.cpp's
#   AMX kernel faults on every quantized model (seen on a Sapphire Rapids host, issue 5);
#   the benchmark records that the control ran without AMX.
# - AVX-512 where the CPU has it (the ggml flags follow /proc/cpuinfo's), AVX2 otherwise.
flags=$(tr ' ' '\n' < /proc/cpuinfo | sort -u)
has() { grep -qx "$1" <<<"$flags"; }
cmake_args=(-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
            -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
case $(uname -m) in
    x86_64)
        for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
                 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
            if has "${f%%:*}"; then cmake_args+=("-DGGML_${f#*:}=ON"); else cmake_args+=("-DGGML_${f#*:}=OFF"); fi
        done ;;
    *)  cmake_args=("${cmake_args[@]/-DGGML_NATIVE=OFF/-DGGML_NATIVE=ON}") ;;
esac

stamp=.venv/.edgepath-llama-cpp
tool_names=(llama-imatrix llama-quantize llama-server)
want="llama-cpp-python $version ${cmake_args[*]}; tools: ${tool_names[*]}; one shared build"
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi

download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" download --no-deps --no-binary :all: -d "$download" "llama-cpp-python==$version"
sdist=$download/llama_cpp_python-$version.tar.gz
got=$(sha256sum "$sdist" | cut -d' ' -f1)
if [[ $got != "$sdist_sha256" ]]; then
    echo "build_llama_cpp: $(basename "$sdist") has sha256 $got, not the pinned $sdist_sha256; refusing it" >&2
    exit 1
fi

# llama.cpp itself, compiled once for the bindings and the tools alike: its shared
# libraries (what the bindings load) and the three tools linked to them, every file in
# one folder with RPATH $ORIGIN so that the tools find the libraries beside them. The
# server without its web UI (its assets would be downloaded) and without OpenSSL (it
# serves plain HTTP on the address `edgepath serve` gives it).
echo "build_llama_cpp: building llama.cpp $version's libraries and ${tool_names[*]} (~8 min on 2 cores)" >&2
tar -xzf "$sdist" -C "$download" "llama_cpp_python-$version/vendor/llama.cpp"
build=$download/build
build_args=()
for arg in "${cmake_args[@]}"; do
    case $arg in
        -DLLAMA_BUILD_TOOLS=OFF|-DLLAMA_BUILD_SERVER=OFF) build_args+=("${arg%=OFF}=ON") ;;
        *) build_args+=("$arg") ;;
    esac
done
cmake -S "$download/llama_cpp_python-$version/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=OFF \
    "${build_args[@]}" \
    > "$download/cmake.log" || { cat "$download/cmake.log" >&2; exit 1; }
cmake --build "$build" --target llama "${tool_names[@]}" -j "$(nproc)" > "$download/build.log" \
    || { tail -50 "$download/build.log" >&2; exit 1; }
libraries=("$build"/bin/lib*.so*)

# The bindings without a build of their own (LLAMA_BUILD=OFF: pure Python), then the
# libraries above where they load them from (llama_cpp/lib). --no-cache-dir and
# --force-reinstall: pip's wheel cache is keyed by the sdist, not by these flags.
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
    "${pip[@]}" install --no-cache-dir --force-reinstall --no-deps "$sdist"
"${pip[@]}" install -c requirements/lock.txt "llama-cpp-python==$version"  # its dependencies, pinned
bindings=$(.venv/bin/python -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent)')
mkdir -p "$bindings/lib"
cp -a "${libraries[@]}" "$bindings/lib/"

# The converter and what it imports (its conversion package, its own gguf-py), one
# llama.cpp version with the engine; the tools and their libraries in bin/.
share=.venv/share/edgepath
mkdir -p "$share"
stage=$(mktemp -d "$share/.llama.cpp.XXXXXX")
tar -xzf "$sdist" -C "$stage" --strip-components=3 \
    "llama_cpp_python-$version/vendor/llama.cpp/convert_hf_to_gguf.py" \
    "llama_cpp_python-$version/vendor/llama.cpp/conversion" \
    "llama_cpp_python-$version/vendor/llama.cpp/gguf-py"
mkdir -p "$stage/bin"
cp -a "${tool_names[@]/#/$build/bin/}" "${libraries[@]}" "$stage/bin/"
rm -rf "$share/llama.cpp"
mv -T "$stage" "$share/llama.cpp"
echo "$want" > "$stamp"
