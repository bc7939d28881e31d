package transport

import (
	"context"
	"database/sql"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A batch whose COMMIT fails after the statement that allows it (as a full
// NOTIFY queue makes it fail, on a live connection) tells nothing: the
// subscriber reports it only by logging it, and commitWatch hears it.
func TestHooksNotRunWhenTheCommitFails(t *testing.T) {
	c, db := internalConsumer(t, nil)
	suffix := strings.ReplaceAll(c.rt.topic, ".", "_")
	eff, trap := "eff_"+suffix, "trap_"+suffix
	_, err := db.SQL.Exec(`CREATE TABLE ` + eff + ` (v text);
CREATE TABLE ` + trap + ` (v int);
CREATE FUNCTION ` + trap + `() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'fails at COMMIT'; END $$;
CREATE CONSTRAINT TRIGGER ` + trap + ` AFTER INSERT ON ` + trap + ` DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ` + trap + `()`)
	require.NoError(t, err)
	log := commitWatch{LoggerAdapter: c.t.wlog, c: c}.With(nil) // as the subscriber holds it

	run := func(failAtCommit bool) (ran bool, rows int) {
		tx, err := c.BeginTx(context.Background(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		require.NoError(t, err)
		mark := time.Now().Format("150405.000000000")
		_, err = tx.Exec(`INSERT INTO `+eff+` VALUES ($1)`, mark)
		require.NoError(t, err)
		var hook atomic.Bool
		c.cur.d.hooks = append(c.cur.d.hooks, func() { hook.Store(true) })
		_, err = tx.Exec(c.commitQuery()) // the commit is allowed
		require.NoError(t, err)
		if failAtCommit {
			// Stand-in for a failure of COMMIT itself on a live connection.
			_, err = tx.Exec(`SET CONSTRAINTS ALL DEFERRED; INSERT INTO ` + trap + ` VALUES (1)`)
			require.NoError(t, err)
		}
		// What watermill-sql's subscriber does: commit, log a failure, and
		// report the poll as done.
		if cerr := tx.Commit(); cerr != nil {
			log.Error(wsqlCommitFailed, cerr, nil)
		}
		c.endBatch(nil)
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM `+eff+` WHERE v = $1`, mark).Scan(&rows))
		return hook.Load(), rows
	}
	ran, rows := run(true)
	assert.Zero(t, rows, "the COMMIT failed")
	assert.False(t, ran, "nothing of a batch that did not commit is told")
	ran, rows = run(false)
	assert.Equal(t, 1, rows)
	assert.True(t, ran, "the next batch commits and tells")
}

// commitWatch relies on the words watermill-sql's subscriber logs when a
// batch's COMMIT fails; the version in go.mod must still log them there.
func TestCommitWatchKnowsWatermillSQL(t *testing.T) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/ThreeDotsLabs/watermill-sql/v3").Output()
	require.NoError(t, err)
	src, err := os.ReadFile(filepath.Join(strings.TrimSpace(string(out)), "pkg", "sql", "subscriber.go"))
	require.NoError(t, err)
	i := strings.Index(string(src), "commitErr := tx.Commit()")
	require.GreaterOrEqual(t, i, 0, "the subscriber commits its batch")
	after := string(src)[i:min(i+400, len(src))]
	assert.Contains(t, after, `logger.Error("`+wsqlCommitFailed+`", commitErr`, "a failed COMMIT is logged with these words, right after it")
}

// A batch's failed COMMIT is the consumer's to report (it retries the
// attempt, or isolates the message at fault, and says so): the line the
// subscriber logs for it is not an ERROR, which would be a false alarm for
// every refusal the commit guard makes by design.
func TestAFailedCommitIsNotLoggedAsAnError(t *testing.T) {
	var buf strings.Builder
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &buf}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	c := &consumer{}
	log := commitWatch{LoggerAdapter: watermill.NewSlogLogger(logger), c: c}.With(nil)
	log.Error(wsqlCommitFailed, errors.New("pgsaga: a delivery transaction cannot commit while an attempt is open"), nil)
	assert.True(t, c.commitFailed.Load(), "heard")
	logged := func() string {
		mu.Lock()
		defer mu.Unlock()
		return buf.String()
	}
	assert.NotContains(t, logged(), "level=ERROR")
	assert.Contains(t, logged(), "cannot commit while an attempt is open", "still told, with its cause")
	log.Error("something else", errors.New("boom"), nil)
	assert.Contains(t, logged(), "level=ERROR", "other errors stay errors")
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *strings.Builder
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
