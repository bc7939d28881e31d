package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cpuMeter reads the CPU time used by this process and its worker
// processes (-worker-processes; those still running) and, when the server
// runs on this machine and /proc is readable, by every PostgreSQL process
// (the postmaster and its children: backends, WAL writer, checkpointer…).
type cpuMeter struct {
	postmaster int // 0 when the server's processes cannot be read
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat times: 100 on every
// Linux architecture Go supports.
const clockTicks = 100

func newCPUMeter(ctx context.Context, db *sql.DB) (*cpuMeter, error) {
	m := &cpuMeter{}
	var backend int
	if err := db.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		return nil, fmt.Errorf("finding the server's processes: %w", err)
	}
	if st, err := readStat(backend); err == nil {
		// Our own backend's parent is the postmaster, if it is local.
		if parent, err := readStat(st.ppid); err == nil && strings.HasPrefix(parent.comm, "postgres") {
			m.postmaster = st.ppid
		}
	}
	return m, nil
}

// sample is a reading of both clocks.
type sample struct {
	at       time.Time
	process  time.Duration
	postgres time.Duration
	pgOK     bool
}

func (m *cpuMeter) read() sample {
	s := sample{at: time.Now()}
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		s.process = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		return s
	}
	self := os.Getpid()
	var pgTicks, childTicks uint64
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		st, err := readStat(pid)
		switch {
		case err != nil:
		case st.ppid == self:
			childTicks += st.utime + st.stime
		case m.postmaster != 0 && (pid == m.postmaster || st.ppid == m.postmaster):
			pgTicks += st.utime + st.stime
		}
	}
	s.process += time.Duration(childTicks) * time.Second / clockTicks
	if m.postmaster != 0 {
		s.postgres = time.Duration(pgTicks) * time.Second / clockTicks
		s.pgOK = true
	}
	return s
}

// usage is the CPU used between two samples.
type usage struct {
	wall     time.Duration
	process  time.Duration
	postgres time.Duration
	pgOK     bool
}

func since(a, b sample) usage {
	return usage{wall: b.at.Sub(a.at), process: b.process - a.process, postgres: b.postgres - a.postgres, pgOK: a.pgOK && b.pgOK}
}

type procStat struct {
	comm         string
	ppid         int
	utime, stime uint64
}

// readStat parses /proc/<pid>/stat: "pid (comm) state ppid … utime stime …".
func readStat(pid int) (procStat, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return procStat{}, err
	}
	s := string(b)
	open, close := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || close < open {
		return procStat{}, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	f := strings.Fields(s[close+1:])
	if len(f) < 13 {
		return procStat{}, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	var st procStat
	st.comm = s[open+1 : close]
	st.ppid, _ = strconv.Atoi(f[1])
	st.utime, _ = strconv.ParseUint(f[11], 10, 64)
	st.stime, _ = strconv.ParseUint(f[12], 10, 64)
	return st, nil
}
