package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

// relayProcess starts `pgsaga relay` as a process of its own and waits
// until it relays.
func relayProcess(t *testing.T, args string) (*exec.Cmd, *testout.Buffer, <-chan error) {
	t.Helper()
	out := &testout.Buffer{}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childArgs+"=relay "+args)
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out.WaitFor(ctx, t, "pgsaga relay: relaying")
	return cmd, out, exited
}

// The relay as a process of its own relays a topic in order; killed
// (SIGKILL) mid-stream and started again, it publishes what it had not
// recorded again, and the broker keeps each message once; SIGTERM stops
// it, exit status 0, saying what it relayed. (A kill exactly between the
// broker's acknowledgement and the relay's commit is pinned in
// steps/broker: TestRelayCrashBetweenPublishAndCommitStoresOnce.)
func TestRelayCommand(t *testing.T) {
	url := testnats.URL(t)
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	topic := "pgsagatest." + hex.EncodeToString(b) + ".relayed"
	_, js := testnats.Connect(t)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), natsjs.StreamName(topic)) })
	tr, err := transport.New(transport.Config{DB: db.SQL})
	require.NoError(t, err)
	publish := func(n int) (ids []string) {
		for i := range n {
			msg := message.NewMessage(uuid.NewString(), fmt.Appendf(nil, `{"i":%d}`, i))
			tx, err := db.SQL.Begin()
			require.NoError(t, err)
			require.NoError(t, tr.Publisher(tx).Publish(topic, msg))
			require.NoError(t, tx.Commit())
			ids = append(ids, msg.UUID)
		}
		return ids
	}
	stored := func(atLeast int) []string {
		ctx := context.Background()
		var got []string
		eventually(t, fmt.Sprintf("the stream holds %d messages", atLeast), func() bool {
			stream, err := js.Stream(ctx, natsjs.StreamName(topic))
			if err != nil {
				return false
			}
			info, err := stream.Info(ctx)
			require.NoError(t, err)
			if int(info.State.Msgs) < atLeast {
				return false
			}
			got = got[:0]
			for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
				m, err := stream.GetMsg(ctx, seq)
				require.NoError(t, err)
				got = append(got, m.Header.Get(natsjs.HeaderUUID))
			}
			return true
		})
		return got
	}
	args := "--broker " + url + " --topic " + topic + " --batch 5 --report-every 0"

	first, _, firstExit := relayProcess(t, args)
	ids := publish(40)
	stored(10)
	require.NoError(t, first.Process.Signal(syscall.SIGKILL))
	<-firstExit

	second, out, exited := relayProcess(t, args)
	ids = append(ids, publish(10)...)
	assert.Equal(t, ids, stored(len(ids)), "each message once, in order")
	eventually(t, "the relay's queue is empty", func() bool {
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1`, topic).Scan(&n))
		return n == 0
	})
	require.NoError(t, second.Process.Signal(syscall.SIGTERM))
	assert.NoError(t, <-exited, "exit status 0:\n%s", out.String())
	assert.Contains(t, out.String(), "pgsaga relay: stopped;")
}

// The relay's command line is checked before anything runs: exit 2.
func TestRelayUsage(t *testing.T) {
	t.Parallel()
	for args, want := range map[string]string{
		"relay --topic a":                                  "--broker is required",
		"relay --broker http://x:1 --topic a":              "unknown broker URL",
		"relay --broker nats://127.0.0.1:4222":             "at least one --topic",
		"relay --broker nats://x:4222 --topic 'a b'":       "invalid topic",
		"relay --broker nats://x:4222 --topic a --batch 0": "--batch must be between 1 and 1000",
	} {
		var stdout, stderr testout.Buffer
		code := run(context.Background(), splitArgs(args), &stdout, &stderr)
		assert.Equal(t, exitUsage, code, args)
		assert.Contains(t, stderr.String(), want, args)
	}
}

// splitArgs splits a command line on spaces, keeping single-quoted words.
func splitArgs(s string) []string {
	var (
		out    []string
		cur    []rune
		quoted bool
	)
	for _, r := range s {
		switch {
		case r == '\'':
			quoted = !quoted
		case r == ' ' && !quoted:
			if len(cur) > 0 {
				out = append(out, string(cur))
				cur = cur[:0]
			}
		default:
			cur = append(cur, r)
		}
	}
	if len(cur) > 0 {
		out = append(out, string(cur))
	}
	return out
}
