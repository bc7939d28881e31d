// Package pgbin finds the machine's PostgreSQL server binaries.
package pgbin

import (
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// Candidates lists directories that may hold PostgreSQL server binaries:
// pg_config --bindir, then /usr/lib/postgresql/*/bin, newest first.
func Candidates() []string {
	var dirs []string
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dirs = append(dirs, strings.TrimSpace(string(out)))
	}
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(found, func(i, j int) bool { return major(found[i]) > major(found[j]) })
	return append(dirs, found...)
}

// First returns the first of dirs holding pg_ctl, initdb and postgres, or "".
func First(dirs []string) string {
	for _, d := range dirs {
		if isFile(filepath.Join(d, "pg_ctl")) && isFile(filepath.Join(d, "postgres")) && isFile(filepath.Join(d, "initdb")) {
			return d
		}
	}
	return ""
}

// Find returns a directory of the machine's server binaries, or "".
func Find() string { return First(Candidates()) }

func major(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

func isFile(path string) bool {
	st, err := os.Stat(path)
	return err == nil && !st.IsDir()
}
