package transport_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/migrations"
)

// A database whose encoding is not UTF8 is refused at start, with one
// sentence saying how to fix it: by the migrations, by Subscribe and by a
// Router's Run, which returns at once instead of spinning.
func TestNonUTF8DatabaseIsRefused(t *testing.T) {
	t.Parallel()
	db := testdb.Custom(t, "TEMPLATE template0 ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C'")
	ctx := context.Background()

	_, err := migrations.Apply(ctx, db.SQL)
	require.ErrorIs(t, err, transport.ErrNotUTF8)
	assert.Contains(t, err.Error(), "uses SQL_ASCII")
	assert.Contains(t, err.Error(), "ENCODING 'UTF8'")

	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: testLogger()})
	require.NoError(t, err)
	require.ErrorIs(t, tr.Subscribe(ctx, transport.Subscription{Topic: "t", ConsumerGroup: "g"}), transport.ErrNotUTF8)
	r, err := tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", "t", "g", func(*message.Message) error { return nil }))
	err = r.Run(ctx)
	require.ErrorIs(t, err, transport.ErrNotUTF8)
	t.Log(err)
}
