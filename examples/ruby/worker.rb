#!/usr/bin/env ruby
# frozen_string_literal: true

# A Ladder consumer in Ruby (Bunny 2.14 or newer), written the way a Sneakers worker is: a class
# names its queue with `from_queue` and returns `ack!` or `reject!` from `work_with_params`.
#
#   worker.rb explicit|dead-letter [--queue orders] [--exchange ladder.default]
#                                  [--prefetch 10] [--fail-always]
#
# reject! hands the message to the ladder. explicit: publish it to the ladder's exchange with
# retry-to = the queue (publisher confirms, mandatory), then ack the original; nack it with
# requeue if the publish is not confirmed. dead-letter: the queue is declared with
# x-dead-letter-exchange = the ladder's exchange, and reject! rejects without requeue.
#
# AMQP_URL names the broker (default amqp://guest:guest@127.0.0.1:5672/%2f). Each delivery
# prints one line on stdout, `<message_id> attempt=<retry-attempt or 0>`; logs go to stderr.

require "bunny"
require "logger"
require "optparse"

LOG = Logger.new($stderr, progname: "worker", formatter: ->(_, _, prog, msg) { "#{prog}: #{msg}\n" })

# The runner: what Sneakers' Worker and its handler do, reduced to what a ladder needs.
module LadderWorker
  def self.included(base)
    base.extend(ClassMethods)
  end

  module ClassMethods
    attr_reader :queue_name, :queue_opts

    def from_queue(name, opts = {})
      @queue_name = name
      @queue_opts = opts
    end
  end

  def ack!
    :ack
  end

  def reject!(reason = nil)
    @reason = reason
    :reject
  end

  # Consumes the queue until interrupted; `mode` is :explicit or :dead_letter.
  def run(connection, mode)
    @mode = mode
    @queue = self.class.queue_name
    @ladder = self.class.queue_opts.fetch(:ladder)
    @channel = connection.create_channel
    @channel.prefetch(self.class.queue_opts.fetch(:prefetch, 10))
    queue = mode == :explicit ? declare_explicit : declare_dead_letter
    LOG.info("#{mode} mode: consuming #{@queue}, failures go to #{@ladder}")
    queue.subscribe(manual_ack: true, block: true) do |delivery_info, properties, body|
      @reason = nil
      case work_with_params(body, delivery_info, properties)
      when :ack then @channel.ack(delivery_info.delivery_tag)
      when :reject then hand_to_ladder(delivery_info, properties, body)
      end
    end
  end

  private

  def hand_to_ladder(delivery_info, properties, body)
    if @mode == :explicit
      retry_explicit(delivery_info, properties, body)
    else
      @channel.reject(delivery_info.delivery_tag, false) # dead-letters it to the ladder
    end
  end

  # README:explicit:start
  # Explicit mode: on reject!, publish the message to the ladder with retry-to = our queue.
  def declare_explicit
    @confirms = @channel.connection.create_channel # one retry in flight: a return is its own
    @confirms.confirm_select
    @returned = false
    @exchange = @confirms.exchange(@ladder, type: :fanout, no_declare: true)
    @exchange.on_return { |_info, _props, _body| @returned = true }
    @channel.queue(@queue, durable: true, arguments: { "x-queue-type" => "quorum" })
  end

  def retry_explicit(delivery_info, properties, body)
    headers = (properties.headers || {}).merge( # a copy: retry-attempt etc. travel along
      "retry-to" => @queue, "retry-reason" => @reason.to_s[0, 200]
    )
    props = properties.to_hash.reject { |k, _| %i[expiration user_id].include?(k) }
    props[:timestamp] = props[:timestamp].to_i if props[:timestamp] # Bunny reads a Time
    @returned = false
    @exchange.publish(body, props.merge(headers: headers, persistent: true, delivery_mode: 2,
                                        routing_key: "", mandatory: true))
    raise "nacked or returned" unless @confirms.wait_for_confirms && !@returned

    @channel.ack(delivery_info.delivery_tag) # only once the retry is confirmed
  rescue StandardError => e
    LOG.warn("#{@queue}: retry not confirmed, requeueing: #{e.message}")
    @channel.nack(delivery_info.delivery_tag, false, true) # keep it
  end
  # README:explicit:end

  # README:dead-letter:start
  # Dead-letter mode: the queue dead-letters into the ladder; reject! rejects without requeue.
  def declare_dead_letter
    @channel.queue(@queue, durable: true, arguments: {
                     "x-queue-type" => "quorum",
                     "x-dead-letter-exchange" => @ladder
                   })
  end
  # README:dead-letter:end
end

# The service's own worker: the part a Sneakers user writes.
class OrdersWorker
  include LadderWorker

  def self.configure(queue:, ladder:, prefetch:, fail_always:)
    from_queue queue, ladder: ladder, prefetch: prefetch
    @fail_always = fail_always
  end

  def self.fail_always?
    @fail_always
  end

  # README:worker:start
  def work_with_params(body, _delivery_info, properties)
    attempt = (properties.headers || {}).fetch("retry-attempt", 0) # 0 = first delivery
    puts "#{properties.message_id} attempt=#{attempt}"
    handle(body)
    ack!
  rescue StandardError => e
    LOG.warn("#{self.class.queue_name}: attempt #{attempt} failed: #{e.message}")
    reject!(e.message) # to the ladder, in either mode
  end
  # README:worker:end

  # The service's own work. Fails every message with --fail-always.
  def handle(_body)
    raise "simulated failure (--fail-always)" if self.class.fail_always?
  end
end

def main
  opts = { queue: "orders", ladder: "ladder.default", prefetch: 10, fail_always: false }
  parser = OptionParser.new do |o|
    o.banner = "usage: worker.rb explicit|dead-letter [options]"
    o.on("--queue NAME", "the queue to consume (and to return failures to)") { |v| opts[:queue] = v }
    o.on("--exchange NAME", "the ladder's exchange, <namespace>.<ladder>") { |v| opts[:ladder] = v }
    o.on("--prefetch N", Integer, "unacked deliveries at most") { |v| opts[:prefetch] = v }
    o.on("--fail-always", "fail every message") { opts[:fail_always] = true }
  end
  parser.parse!
  mode = { "explicit" => :explicit, "dead-letter" => :dead_letter }[ARGV.first]
  abort(parser.banner) unless mode && ARGV.size == 1
  $stdout.sync = true

  OrdersWorker.configure(**opts)
  connection = Bunny.new(ENV.fetch("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
                         logger: Logger.new($stderr, level: Logger::WARN))
  connection.start
  OrdersWorker.new.run(connection, mode)
rescue Interrupt
  connection&.close
end

main if $PROGRAM_NAME == __FILE__
