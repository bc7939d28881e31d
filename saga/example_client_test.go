package saga_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// A signup saga: open an account, then send a welcome e-mail; if the
// e-mail cannot be sent, close the account again.

type SignedUp struct {
	Email string `json:"email"`
}

func (SignedUp) MessageType() string { return "example.SignedUp" }

type OpenAccount struct {
	Email string `json:"email"`
}

func (OpenAccount) MessageType() string { return "example.OpenAccount" }

type CloseAccount struct {
	Email string `json:"email"`
}

func (CloseAccount) MessageType() string { return "example.CloseAccount" }

type SendWelcome struct {
	Email string `json:"email"`
}

func (SendWelcome) MessageType() string { return "example.SendWelcome" }

type Done struct{}

func (Done) MessageType() string { return "example.Done" }

type signup struct {
	Email string `json:"email"`
}

// Define a saga and its steps, serve them with a Client, start an instance
// in your own transaction, and read its timeline once it ends.
func ExampleClient() {
	ctx := context.Background()
	db := testdb.ForExample()
	run := uuid.NewString()[:8] // keeps this example's topics apart in a shared database

	client, err := saga.NewClient(db.Pool, saga.ClientConfig{
		FinishedChannel: "signup_finished_" + run,
		Logger:          slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		panic(err)
	}

	// The participants' steps: typed handlers whose writes go through the
	// step's transaction, with the command's idempotency key claimed in it.
	open := steps.Define("accounts.open-"+run, "accounts.open."+run,
		func(ctx context.Context, tx *steps.Tx, cmd OpenAccount) (steps.Message, error) {
			return Done{}, nil
		})
	closeAccount := steps.Define("accounts.close-"+run, "accounts.close."+run,
		func(ctx context.Context, tx *steps.Tx, cmd CloseAccount) (steps.Message, error) {
			return Done{}, nil
		})
	welcome := steps.Define("mail.welcome-"+run, "mail.welcome."+run,
		func(ctx context.Context, tx *steps.Tx, cmd SendWelcome) (steps.Message, error) {
			if !strings.Contains(cmd.Email, "@") {
				// Final: answered with this reason, and the saga compensates.
				return nil, steps.Fail(nil, "not an e-mail address")
			}
			return Done{}, nil
		})

	// The saga: a trigger and its steps, in order.
	def := saga.MustDefine(saga.Spec[signup]{
		Name:    "signup-" + run,
		Trigger: saga.On("signups."+run, func(s SignedUp) (string, signup, error) { return s.Email, signup(s), nil }),
		Steps: []saga.Step[signup]{
			{Name: "account",
				Action:       saga.Send(open, func(s signup) OpenAccount { return OpenAccount(s) }),
				Compensation: saga.Send(closeAccount, func(s signup) CloseAccount { return CloseAccount(s) }),
				Deadline:     10 * time.Second},
			{Name: "welcome",
				Action:   saga.Send(welcome, func(s signup) SendWelcome { return SendWelcome(s) }),
				Deadline: 10 * time.Second},
		},
	})
	if err := client.Register(def); err != nil {
		panic(err)
	}
	if err := client.AddSteps(open, closeAccount, welcome); err != nil {
		panic(err)
	}
	if err := client.Start(ctx); err != nil {
		panic(err)
	}
	defer client.Stop(context.Background()) //nolint:errcheck

	// Start sagas in your own transaction: they start if, and only if, the
	// transaction commits, with whatever else you wrote in it.
	tx, err := client.DB().BeginTx(ctx, nil)
	if err != nil {
		panic(err)
	}
	emails := []string{"ada@example.com", "grace"}
	ids := make([]uuid.UUID, len(emails))
	for i, email := range emails {
		if ids[i], err = client.StartTx(ctx, tx, def.Name, SignedUp{Email: email}); err != nil {
			panic(err)
		}
	}
	if err := tx.Commit(); err != nil {
		panic(err)
	}

	// Wait for them to end (no polling: the engine announces every end).
	for i, email := range emails {
		inst, err := client.WaitFinished(ctx, ids[i])
		if err != nil {
			panic(err)
		}
		fmt.Println(strings.TrimSpace(fmt.Sprintf("%s: %s %s", email, inst.Status, inst.FailureReason)))
		for _, h := range inst.History {
			fmt.Println(strings.TrimSpace(fmt.Sprintf("%-12s %-8s %s", h.Kind, h.Step, h.Phase)))
		}
	}
	// Output:
	// ada@example.com: completed
	// started
	// sent         account  action
	// reply_ok     account  action
	// sent         welcome  action
	// reply_ok     welcome  action
	// completed
	// grace: compensated welcome: not an e-mail address
	// started
	// sent         account  action
	// reply_ok     account  action
	// sent         welcome  action
	// reply_failed welcome  action
	// sent         account  compensation
	// reply_ok     account  compensation
	// compensated
}
