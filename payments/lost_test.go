package payments_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testlost"
)

// Opening an account and depositing (the seeding of the sample's programs)
// ride out a connection lost under them, and happen once.
func TestSeedingRetriesALostConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("OpenAccount, terminated", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		id := "acct-" + uuid.NewString()[:8]
		err := testlost.Terminated(t, e.db, `INSERT INTO accounts (account_id) VALUES ($1)`, []any{id}, func() error {
			return e.svc.OpenAccount(ctx, id)
		})
		require.NoError(t, err)
		assert.Equal(t, int64(0), e.balance(id), "the account is open")
	})

	t.Run("Deposit, terminated", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		id := e.account(0)
		err := testlost.Terminated(t, e.db, `UPDATE accounts SET version = version WHERE account_id = $1`, []any{id}, func() error {
			return e.svc.Deposit(ctx, id, 700, "seed")
		})
		require.NoError(t, err)
		assert.Equal(t, int64(700), e.balance(id))
	})

	t.Run("Deposit, cut once its COMMIT is sent", func(t *testing.T) {
		t.Parallel()
		db := testlost.OpenCuttable(t, testdb.Shared(t), 4)
		e := newEnvWith(t, envOptions{db: db.DB})
		id := e.account(0)
		db.CutAfter(testlost.Commits...)
		require.NoError(t, e.svc.Deposit(ctx, id, 700, "seed"))
		assert.True(t, db.Cut(), "a COMMIT was cut off")
		assert.Equal(t, int64(700), e.balance(id), "deposited once")
	})
}
