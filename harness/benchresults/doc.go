// Package benchresults writes the results files of the project's benchmark
// runs: Markdown meant to be committed under docs/results and included by
// the handbook, so that every figure there comes from the run that made it.
//
// A file starts with a header that says where the numbers come from (the
// date, the commit and whether the tree had uncommitted changes, the
// machine, its load average at the start and the end of the run, the Go
// version, the exact command and the environment knobs set), then one
// table per area. [Run] gathers and writes the header, [Table] writes a
// table, [ParseGoBench] reads the output of `go test -bench` (as
// scripts/bench.sh logs it, one or several rounds of every area) and
// [GoBench.Tables] turns it into a table per area: each ratio next to the
// raw metrics and, when the run had several rounds, each value's median
// and its range over the rounds.
//
// A run that is not meant to be read (the small sizes CI runs so that the
// benchmarks cannot rot, a subset, other sizes) says so at the top of its
// file ([Run.Draft]) and is written outside docs/.
//
// scripts/bench.sh uses it through the command in cmd/benchresults;
// bench/peers imports it.
package benchresults
