# Sourced by build.sh and addons/build.sh: how every Go binary of the test tier is compiled.
#   -trimpath                 no local paths in the binaries
#   -gcflags=all=-dwarf=false no debug info is generated (the link drops it anyway: -ldflags -s -w); about 10 %
#                             less compile CPU, measured on kwok cold (217 -> 184 CPU-s together with GOGC)
#   GOGC=200                  the compiler collects garbage half as often, for more memory per compile (2x);
#                             400 saved a little more but these builds may overlap the tests' peak memory
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOGC=200
GO_BUILD_FLAGS=(-trimpath -gcflags=all=-dwarf=false)
