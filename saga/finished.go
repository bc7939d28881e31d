package saga

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/pglisten"
)

// ListenFinished calls finished with the id of every instance that ends,
// as announced on an engine's Config.FinishedChannel, until ctx is done. It
// holds one connection of db, and reconnects when it is lost. Instances that
// end while it is reconnecting are not announced: relisten is called after
// every reconnect (not the first LISTEN), so the caller can look those up
// (Get, List). Both callbacks run on the listener's goroutine: keep them
// short. It returns nil when ctx is done.
func ListenFinished(ctx context.Context, db *sql.DB, channel string, finished func(id uuid.UUID), relisten func(), logger *slog.Logger) error {
	first := true
	l, err := pglisten.New(pglisten.Config{
		DB:       db,
		Channels: []string{channel},
		OnNotify: func(_, payload string) {
			if id, err := uuid.Parse(payload); err == nil {
				finished(id)
			}
		},
		OnListen: func() {
			if !first && relisten != nil {
				relisten()
			}
			first = false
		},
		Logger: logger,
	})
	if err != nil {
		return fmt.Errorf("saga: listening for finished instances: %w", err)
	}
	return l.Run(ctx)
}
